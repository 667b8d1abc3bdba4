//! The scalar reference of scaling (`super`): `x *= factor`, element by element, generic
//! over [`Real`] as the other references are.

use crate::reference::Real;

/// x: (N) *= `factor`.
pub fn scale<R: Real>(x: &mut [R], factor: R) {
    for v in x {
        *v = *v * factor;
    }
}
