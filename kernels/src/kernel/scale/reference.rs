//! The scalar references of the family (`super`): scaling, `x *= factor`, element by
//! element, generic over [`Real`] as the other references are; and rounding f32 to bf16's
//! precision, through the `half` crate's conversion.

use crate::reference::Real;

/// x: (N) *= `factor`.
pub fn scale<R: Real>(x: &mut [R], factor: R) {
    for v in x {
        *v = *v * factor;
    }
}

/// x: (N) rounded to the nearest bf16 value (ties to even), as f32.
pub fn round_bf16(x: &mut [f32]) {
    for v in x {
        *v = half::bf16::from_f32(*v).to_f32();
    }
}
