//! Devices. On both devices, each test written once (`test_device!`: a CPU test, and a
//! GPU test ignored unless asked for, failing without a GPU): a device holds its budget,
//! pinned memory is locked as the device asks, copies are ordered by events across the
//! copy streams, no pinned slot is reused while a copy holds it, a program runs between
//! its copies, a tensor outside its binding is refused. On the CPU device alone (what
//! only it has: host closures, its view checker, copy latency, chaos, widening copies):
//! copies and compute ordered by events, an ordering bug caught instead of raced, a
//! failure that stops the device. On a GPU alone: timed copies. And device selection.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use strata_engine::device::{
    CpuDevice, CpuDeviceConfig, Device, DeviceChoice, DeviceConfig, DeviceKind, Event, select,
};
use strata_engine::memory::{HostLocking, PinnedPool, PinnedPoolConfig, Pinning, SlotLease};
use strata_engine::{EngineError, Lane};
use support::{DeviceSpec, test_device};

fn cpu_device(copy_latency: Duration) -> Device {
    Device::Cpu(
        CpuDevice::new(CpuDeviceConfig {
            memory_budget_bytes: 1 << 20,
            copy_latency,
            ..CpuDeviceConfig::default()
        })
        .unwrap(),
    )
}

fn pool_for(device: &Device, slot_bytes: usize, slot_count: usize) -> PinnedPool {
    PinnedPool::new(
        PinnedPoolConfig {
            name: format!("{}-test", device.name()),
            budget_bytes: slot_bytes * slot_count,
            slot_bytes,
            acquire_timeout: Duration::from_millis(20),
        },
        &device.pinning(),
    )
    .unwrap()
}

fn filled(pool: &PinnedPool, byte: impl Fn(usize) -> u8) -> SlotLease {
    let mut lease = pool.acquire().unwrap();
    for (i, b) in lease.as_mut_slice().iter_mut().enumerate() {
        *b = byte(i);
    }
    lease
}

/// The source of an operation's failure, for matching on.
fn cause(error: &EngineError) -> &EngineError {
    match error {
        EngineError::OperationFailed { source, .. } => cause(source),
        other => other,
    }
}

test_device!(
    a_device_holds_its_budget,
    DeviceSpec::new(1 << 20).copies_only()
);

fn a_device_holds_its_budget(device: &Device) {
    let a = device.alloc(768 << 10).unwrap();
    match device.alloc(512 << 10) {
        Err(EngineError::DeviceOutOfBudget {
            device: name,
            budget_bytes,
            ..
        }) => {
            assert_eq!(name, device.name());
            assert_eq!(budget_bytes, 1 << 20);
        }
        other => panic!("expected DeviceOutOfBudget, got {other:?}"),
    }
    drop(a);
    let b = device.alloc(1 << 20).unwrap();
    assert_eq!(device.arena_stats().in_use_bytes, 1 << 20);
    assert_eq!(device.arena_stats().high_water_bytes, 1 << 20);
    drop(b);
    assert_eq!(device.arena_stats().in_use_bytes, 0);
}

#[test]
fn copy_compute_copy_are_ordered_by_events() {
    // Slow copies: if compute did not wait for the upload, it would read zeros.
    let device = cpu_device(Duration::from_millis(100));
    let pool = pool_for(&device, 4096, 2);
    let input = device.alloc(4096).unwrap();
    let output = device.alloc(4096).unwrap();
    let upload = device
        .copy_h2d(&input, filled(&pool, |i| (i % 100) as u8), &[])
        .unwrap();
    let (a, b) = (input.clone(), output.clone());
    let compute = device
        .run(&[upload.event().clone()], move |mem| {
            let src = mem.read(&a)?;
            let mut dst = mem.write(&b)?;
            for (d, s) in dst.iter_mut().zip(src.iter()) {
                *d = s * 2;
            }
            Ok(())
        })
        .unwrap();
    let download = device
        .copy_d2h(
            pool.acquire().unwrap(),
            &output,
            std::slice::from_ref(&compute),
        )
        .unwrap();
    let result = download.wait().unwrap();
    assert!(
        result
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &v)| v == (i % 100) as u8 * 2)
    );
    // The upload hands its slot back once its copy has completed.
    let slot = upload.wait().unwrap();
    assert!(
        slot.as_slice()
            .iter()
            .enumerate()
            .all(|(i, &v)| v == (i % 100) as u8)
    );
    drop((slot, result));
    assert_eq!(pool.stats().in_use_slots, 0);
}

#[test]
fn compute_starts_only_after_the_copy_it_waits_for_has_ended() {
    let device = cpu_device(Duration::from_millis(150));
    let pool = pool_for(&device, 4096, 1);
    let buffer = device.alloc(4096).unwrap();
    let upload = device.copy_h2d(&buffer, filled(&pool, |_| 7), &[]).unwrap();
    let b = buffer.clone();
    let sum = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = sum.clone();
    let compute = device
        .run(&[upload.event().clone()], move |mem| {
            let bytes = mem.read(&b)?;
            let total: u64 = bytes.iter().map(|&x| u64::from(x)).sum();
            seen.store(total, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        })
        .unwrap();
    compute.wait().unwrap();
    assert_eq!(sum.load(std::sync::atomic::Ordering::SeqCst), 7 * 4096);
    let (Event::Cpu(copy), Event::Cpu(run)) = (upload.event(), &compute) else {
        unreachable!("a CPU device makes CPU events")
    };
    let (_, copy_ended) = copy.run_time().unwrap();
    let (run_started, _) = run.run_time().unwrap();
    assert!(run_started >= copy_ended);
    assert!(compute.elapsed_since(upload.event()).is_ok());
}

// The CPU device holds the copy in flight by its latency; a GPU, by its size.
test_device!(
    no_pinned_slot_is_reused_while_a_copy_reads_it,
    DeviceSpec::new(256 << 20)
        .cpu_copy_latency_ms(300)
        .copies_only()
);

fn no_pinned_slot_is_reused_while_a_copy_reads_it(device: &Device) {
    // One slot.
    let len = match device.kind() {
        DeviceKind::Cpu => 4096,
        DeviceKind::Cuda => 256 << 20,
    };
    let pool = pool_for(device, len, 1);
    let buffer = device.alloc(len).unwrap();
    let upload = device
        .copy_h2d(&buffer, filled(&pool, |_| 0xA1), &[])
        .unwrap();
    if device.kind() == DeviceKind::Cpu {
        assert!(!upload.is_complete().unwrap(), "held by the copy latency");
    }
    // While the transfer holds the slot it is not in the pool.
    assert!(pool.try_acquire().is_none());
    assert!(matches!(
        pool.acquire_timeout(Duration::from_millis(20)),
        Err(EngineError::PinnedPoolExhausted {
            in_use_slots: 1,
            ..
        })
    ));
    let event = upload.event().clone();
    // Dropping the transfer waits for the copy before the slot goes back.
    drop(upload);
    assert!(event.is_complete().unwrap());
    // Reuse the slot for new data: the device must still hold what the copy read.
    let mut reused = pool.try_acquire().expect("the slot is back after its copy");
    reused.as_mut_slice().fill(0xB2);
    let download = device.copy_d2h(reused, &buffer, &[event]).unwrap();
    let slot = download.wait().unwrap();
    assert!(slot.as_slice().iter().all(|&b| b == 0xA1));
    assert_eq!(pool.stats().high_water_slots, 1);
}

#[test]
fn a_missing_dependency_is_an_ordering_violation_not_a_race() {
    let device = cpu_device(Duration::ZERO);
    let pool = pool_for(&device, 4096, 1);
    let buffer = device.alloc(4096).unwrap();
    // A compute operation writes the buffer and holds its view until told to let go.
    let (holding_tx, holding_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let b = buffer.clone();
    let compute = device
        .run(&[], move |mem| {
            let mut view = mem.write(&b)?;
            view.fill(1);
            holding_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            Ok(())
        })
        .unwrap();
    holding_rx.recv().unwrap();
    // An upload into the same buffer that forgot to wait for the compute.
    let upload = device.copy_h2d(&buffer, filled(&pool, |_| 2), &[]).unwrap();
    let error = upload.wait().unwrap_err();
    match cause(&error) {
        EngineError::OrderingViolation {
            lane,
            access,
            other_lane,
            other_access,
            start_bytes,
            end_bytes,
            ..
        } => {
            assert_eq!(*lane, Lane::H2d);
            assert_eq!(*access, "writes");
            assert_eq!(*other_lane, Lane::Compute);
            assert_eq!(*other_access, "is writing");
            assert_eq!(end_bytes - start_bytes, 4096);
        }
        other => panic!("expected an ordering violation, got {other}"),
    }
    assert!(error.to_string().contains("missing a dependency"));
    // The failed copy gave its slot back.
    assert!(pool.try_acquire().is_some());
    release_tx.send(()).unwrap();
    compute.wait().unwrap();
}

#[test]
fn a_failed_operation_fails_its_dependents_and_stops_the_device() {
    let device = cpu_device(Duration::ZERO);
    let failing = device
        .run(&[], |_| {
            Err(EngineError::Unsupported {
                device: "cpu".into(),
                what: "this test",
            })
        })
        .unwrap();
    let dependent = device
        .run(std::slice::from_ref(&failing), |_| Ok(()))
        .unwrap();
    assert!(matches!(
        cause(&dependent.wait().unwrap_err()),
        EngineError::DeviceFailed { .. } | EngineError::Unsupported { .. }
    ));
    assert!(failing.is_complete().is_err());
    // Like a CUDA context after a fault, the device runs nothing more, and says why.
    let later = device.run(&[], |_| Ok(())).unwrap();
    match cause(&later.wait().unwrap_err()) {
        EngineError::DeviceFailed { first, .. } => {
            assert!(
                matches!(cause(first), EngineError::Unsupported { .. }),
                "{first}"
            )
        }
        other => panic!("expected the device to have stopped, got {other}"),
    }
    assert!(device.record(Lane::D2h).unwrap().wait().is_err());
    let error = device.synchronize().unwrap_err();
    assert!(error.to_string().contains("this test"), "{error}");
}

#[test]
fn a_panicking_operation_is_an_error_not_a_crash() {
    let device = cpu_device(Duration::ZERO);
    let panicking = device.run(&[], |_| panic!("kernel bug")).unwrap();
    match cause(&panicking.wait().unwrap_err()) {
        EngineError::OperationPanicked { lane, message } => {
            assert_eq!(*lane, Lane::Compute);
            assert_eq!(message, "kernel bug");
        }
        other => panic!("expected a panic report, got {other}"),
    }
    assert!(
        device.synchronize().is_err(),
        "the failure is not forgotten"
    );
}

#[test]
fn work_after_a_failed_upload_does_not_run_on_stale_memory() {
    // The upload fails (it races an unordered compute); the compute lane is told to wait
    // for it, and the next kernel names no events of its own. It must not run, and
    // synchronize must not report success.
    let device = cpu_device(Duration::ZERO);
    let pool = pool_for(&device, 4096, 1);
    let buffer = device.alloc(4096).unwrap();
    let (holding_tx, holding_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let b = buffer.clone();
    let writer = device
        .run(&[], move |mem| {
            let _view = mem.write(&b)?;
            holding_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            Ok(())
        })
        .unwrap();
    holding_rx.recv().unwrap();
    let upload = device.copy_h2d(&buffer, filled(&pool, |_| 2), &[]).unwrap();
    let upload_event = upload.event().clone();
    assert!(upload.wait().is_err());
    release_tx.send(()).unwrap();
    writer.wait().unwrap();
    device.wait_for(Lane::Compute, &[upload_event]).unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let ran_too = Arc::clone(&ran);
    let kernel = device
        .run(&[], move |_| {
            ran_too.store(true, Ordering::SeqCst);
            Ok(())
        })
        .unwrap();
    assert!(kernel.wait().is_err());
    assert!(
        !ran.load(Ordering::SeqCst),
        "the kernel ran after a failed upload"
    );
    assert!(device.synchronize().is_err());
}

#[test]
fn typed_views_and_foreign_buffers() {
    let device = cpu_device(Duration::ZERO);
    let other = cpu_device(Duration::ZERO);
    let floats = device.alloc(16 * 4).unwrap();
    let foreign = other.alloc(64).unwrap();
    let f = floats.clone();
    device
        .run(&[], move |mem| {
            let mut view = mem.write(&f)?;
            for (i, x) in view.typed_mut::<f32>().iter_mut().enumerate() {
                *x = i as f32 * 0.5;
            }
            Ok(())
        })
        .unwrap()
        .wait()
        .unwrap();
    let f = floats.slice(8..16);
    device
        .run(&[], move |mem| {
            assert_eq!(mem.read(&f)?.typed::<f32>(), &[1.0, 1.5]);
            Ok(())
        })
        .unwrap()
        .wait()
        .unwrap();
    let error = device
        .run(&[], move |mem| mem.read(&foreign).map(drop))
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(
        cause(&error),
        EngineError::ForeignResource {
            what: "a buffer",
            ..
        }
    ));
}

#[test]
fn select_says_which_device_and_why() {
    let config = DeviceConfig {
        memory_budget_bytes: 1 << 20,
        cuda_ordinal: 0,
        cuda_needs_kernels: true,
    };
    let (cpu, reason) = select(DeviceChoice::Cpu, &config).unwrap();
    assert_eq!(cpu.kind(), DeviceKind::Cpu);
    assert!(reason.contains("asked for"), "{reason}");

    let gpu = strata_engine::kernels::cuda::probe().require_all();
    let (auto, reason) = select(DeviceChoice::Auto, &config).unwrap();
    println!("auto: {reason}");
    match &gpu {
        Ok(()) => assert_eq!(auto.kind(), DeviceKind::Cuda),
        Err(why) => {
            assert_eq!(auto.kind(), DeviceKind::Cpu);
            assert!(reason.contains(&why.reason), "{reason}");
        }
    }
    match (select(DeviceChoice::Cuda, &config), &gpu) {
        (Ok((device, _)), Ok(())) => assert_eq!(device.kind(), DeviceKind::Cuda),
        (Err(EngineError::CudaUnavailable(e)), Err(why)) => assert_eq!(&e, why),
        (other, _) => panic!("select(cuda) disagrees with the probe: {other:?}"),
    }
    // Host closures run on the CPU device only; a GPU says it runs kernels instead.
    match (auto.kind(), auto.run(&[], |_| Ok(()))) {
        (DeviceKind::Cpu, Ok(done)) => done.wait().unwrap(),
        (DeviceKind::Cuda, Err(EngineError::Unsupported { .. })) => {}
        (kind, other) => panic!("run on {kind:?} gave {other:?}"),
    }
    assert_eq!(
        <DeviceChoice as clap::ValueEnum>::from_str("cuda", true),
        Ok(DeviceChoice::Cuda)
    );
}

test_device!(
    pinned_memory_is_locked_as_the_device_asks,
    DeviceSpec::new(1 << 20).copies_only()
);

fn pinned_memory_is_locked_as_the_device_asks(device: &Device) {
    let pool = pool_for(device, 1 << 20, 2);
    match (device.pinning(), pool.locking()) {
        (Pinning::Cuda(_), HostLocking::CudaRegistered) => {}
        // mlock may be refused (RLIMIT_MEMLOCK); the pool then says why.
        (Pinning::Mlock, HostLocking::Mlocked | HostLocking::Unlocked { .. }) => {}
        (pinning, locking) => panic!("{pinning:?} gave {locking:?}"),
    }
}

test_device!(
    a_round_trip_is_ordered_by_events_across_the_copy_streams,
    DeviceSpec::new(2 * (64 << 20)).copies_only()
);

fn a_round_trip_is_ordered_by_events_across_the_copy_streams(device: &Device) {
    const LEN: usize = 64 << 20;
    let pool = pool_for(device, LEN, 2);
    let buffer = device.alloc(LEN).unwrap();
    let upload = device
        .copy_h2d(&buffer, filled(&pool, |i| (i % 251) as u8), &[])
        .unwrap();
    // The download runs on the other stream: only the event orders it after the upload.
    let download = device
        .copy_d2h(pool.acquire().unwrap(), &buffer, &[upload.event().clone()])
        .unwrap();
    let result = download.wait().unwrap();
    assert!(
        result
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i % 251) as u8)
    );
    let event = upload.event().clone();
    let slot = upload.wait().unwrap();
    assert!(event.is_complete().unwrap());
    drop(slot);
    let start = device.record(Lane::H2d).unwrap();
    let end = device.record(Lane::H2d).unwrap();
    assert!(end.elapsed_since(&start).is_ok());
}

#[test]
#[ignore = "needs a GPU"]
fn a_gpu_times_copies_in_both_directions_at_once() {
    const LEN: usize = 16 << 20;
    let device = support::open(DeviceKind::Cuda, DeviceSpec::new(2 * LEN).copies_only());
    let cuda = device.as_cuda().unwrap();
    let pool = pool_for(&device, LEN, 2);
    let up = device.alloc(LEN).unwrap();
    let down = device.alloc(LEN).unwrap();
    let source = filled(&pool, |i| (i % 13) as u8);
    let mut sink = pool.acquire().unwrap();
    let upload_time = cuda
        .time_copies(Some((source.as_slice(), &up)), None)
        .unwrap();
    let both_time = cuda
        .time_copies(
            Some((source.as_slice(), &down)),
            Some((&up, sink.as_mut_slice())),
        )
        .unwrap();
    assert!(upload_time > Duration::ZERO && both_time > Duration::ZERO);
    assert!(
        sink.as_slice()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i % 13) as u8)
    );
    println!("16 MiB: H2D {upload_time:?}, H2D+D2H {both_time:?}");
}

// Programs and copies between a host arena and device ranges: the interface the executor
// uses, on both devices.

use strata_engine::device::{Bindings, DeviceRange};
use strata_engine::kernels::kernel::Gelu;
use strata_engine::kernels::ops::{self, Cpu};
use strata_engine::kernels::program::{Dtype, Kernel, Scalars, TensorRef};
use strata_engine::memory::{HostArena, HostRange};

const N: usize = 4099;

/// The input values, their host arena, and a device with room for two f32 tensors of N.
fn program_rig(device: &Device) -> (Vec<f32>, HostArena, [DeviceRange; 2]) {
    let input: Vec<f32> = (0..N).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let host = HostArena::new("test", 2 * 4 * N, &device.pinning()).unwrap();
    host.write(Lane::Cpu, HostRange::new(0, 4 * N))
        .unwrap()
        .copy_from_slice(strata_engine::device::bytes_of(&input));
    let a = DeviceRange::of(&device.alloc(4 * N).unwrap());
    let b = DeviceRange::of(&device.alloc(4 * N).unwrap());
    (input, host, [a, b])
}

/// out = gelu(in), bound at indices 0 (out) and 1 (in).
fn gelu_program(dtype: Dtype) -> strata_engine::device::Program {
    vec![Kernel::Gelu(Gelu {
        out: TensorRef::new(0, 0, N, dtype),
        inp: TensorRef::new(1, 0, N, dtype),
    })]
    .into()
}

/// Upload, a program, download, each ordered after the last by events only.
fn upload_gelu_download(
    device: &Device,
    host: &HostArena,
    a: DeviceRange,
    b: DeviceRange,
) -> Vec<f32> {
    let (src, dst) = (HostRange::new(0, 4 * N), HostRange::new(4 * N, 4 * N));
    let up = device.copy_to_device(host, src, a, None, &[]).unwrap();
    let mut bind = Bindings::default();
    bind.set(0, b);
    bind.set(1, a);
    let run = device
        .run_program(
            Lane::Compute,
            &gelu_program(Dtype::F32),
            &bind,
            &Scalars::default(),
            &[up],
        )
        .unwrap();
    let down = device.copy_to_host(b, host, dst, &[run]).unwrap();
    down.wait().unwrap();
    let bytes = host.read(Lane::Cpu, dst).unwrap();
    strata_engine::device::cast::<f32>(&bytes).to_vec()
}

// Slow copies on the CPU device: a program that did not wait for the upload would read
// zeros.
test_device!(
    a_program_runs_between_its_copies_ordered_by_events,
    DeviceSpec::new(1 << 20).cpu_copy_latency_ms(50)
);

fn a_program_runs_between_its_copies_ordered_by_events(device: &Device) {
    let (input, host, [a, b]) = program_rig(device);
    let got = upload_gelu_download(device, &host, a, b);
    let mut want = vec![0.0; N];
    ops::gelu_forward(&Cpu::default(), &mut want, &input);
    match device.kind() {
        // The same kernel on the same inputs: the same bits.
        DeviceKind::Cpu => assert_eq!(got, want),
        DeviceKind::Cuda => {
            assert_eq!(host.locking(), &HostLocking::CudaRegistered);
            let err = rel_err(&got, &want);
            assert!(err < 1e-5, "relative error {err:.2e}");
        }
    }
    assert_eq!(device.copied_bytes(), [4 * N as u64, 4 * N as u64]);
}

/// ‖got − want‖ / ‖want‖.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let diff = norm(&mut got.iter().zip(want).map(|(g, w)| f64::from(g - w)));
    diff / norm(&mut want.iter().map(|w| f64::from(*w)))
}

#[test]
fn a_program_that_forgot_its_upload_is_an_ordering_violation() {
    let device = cpu_device(Duration::from_millis(200));
    let (_, host, [a, b]) = program_rig(&device);
    let up = device
        .copy_to_device(&host, HostRange::new(0, 4 * N), a, None, &[])
        .unwrap();
    let mut bind = Bindings::default();
    bind.set(0, b);
    bind.set(1, a);
    // The upload holds its write view for 200 ms; the program reads the same bytes.
    std::thread::sleep(Duration::from_millis(50));
    let run = device
        .run_program(
            Lane::Compute,
            &gelu_program(Dtype::F32),
            &bind,
            &Scalars::default(),
            &[],
        )
        .unwrap();
    let error = run.wait().unwrap_err();
    assert!(
        matches!(
            cause(&error),
            EngineError::OrderingViolation {
                lane: Lane::Compute,
                other_lane: Lane::H2d,
                ..
            }
        ),
        "{error}"
    );
    let _ = up.wait();
}

#[test]
fn a_host_arena_range_is_checked_against_the_copies_using_it() {
    let device = cpu_device(Duration::from_millis(200));
    let (_, host, [a, _]) = program_rig(&device);
    let src = HostRange::new(0, 4 * N);
    let up = device.copy_to_device(&host, src, a, None, &[]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // The copy reads the range: a host lane writing it now is refused, reading is shared.
    assert!(matches!(
        host.write(Lane::Cpu, src),
        Err(EngineError::OrderingViolation {
            other_lane: Lane::H2d,
            ..
        })
    ));
    assert!(host.read(Lane::Cpu, src).is_ok());
    up.wait().unwrap();
    assert!(host.write(Lane::Cpu, src).is_ok());
}

#[test]
fn the_cpu_device_widens_bf16_and_fp16_on_the_way_in() {
    let device = cpu_device(Duration::ZERO);
    let values: Vec<f32> = (0..N).map(|i| i as f32 * 0.125 - 7.0).collect();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let host = HostArena::new("test", 2 * N, &device.pinning()).unwrap();
        let range = HostRange::new(0, 2 * N);
        {
            let mut bytes = host.write(Lane::Cpu, range).unwrap();
            for (i, v) in values.iter().enumerate() {
                let b = match dtype {
                    Dtype::Bf16 => half::bf16::from_f32(*v).to_le_bytes(),
                    _ => half::f16::from_f32(*v).to_le_bytes(),
                };
                bytes[2 * i..2 * i + 2].copy_from_slice(&b);
            }
        }
        let dev = DeviceRange::of(&device.alloc(4 * N).unwrap());
        device
            .copy_to_device(&host, range, dev, Some((dtype, Dtype::F32)), &[])
            .unwrap()
            .wait()
            .unwrap();
        let back = HostArena::new("back", 4 * N, &device.pinning()).unwrap();
        let all = HostRange::new(0, 4 * N);
        device
            .copy_to_host(dev, &back, all, &[])
            .unwrap()
            .wait()
            .unwrap();
        let got = back.read(Lane::Cpu, all).unwrap();
        let want: Vec<f32> = values
            .iter()
            .map(|&v| match dtype {
                Dtype::Bf16 => half::bf16::from_f32(v).to_f32(),
                _ => half::f16::from_f32(v).to_f32(),
            })
            .collect();
        let same = strata_engine::device::cast::<f32>(&got)
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{dtype}: widened values differ from half's");
    }
}

test_device!(
    a_tensor_outside_its_binding_is_refused_naming_the_kernel,
    DeviceSpec::new(1 << 20)
);

fn a_tensor_outside_its_binding_is_refused_naming_the_kernel(device: &Device) {
    let (_, _, [a, b]) = program_rig(device);
    let mut bind = Bindings::default();
    bind.set(0, b.sub(0, 4 * (N - 1)));
    bind.set(1, a);
    let error = device
        .run_program(
            Lane::Compute,
            &gelu_program(Dtype::F32),
            &bind,
            &Scalars::default(),
            &[],
        )
        .unwrap_err();
    assert!(
        matches!(
            cause(&error),
            EngineError::ProgramBinding { kernel: "gelu", .. }
        ),
        "{error}"
    );
}

#[test]
fn chaos_reorders_the_streams_but_not_the_results() {
    for seed in [1, 2, 3] {
        let device = Device::Cpu(
            CpuDevice::new(CpuDeviceConfig {
                memory_budget_bytes: 1 << 20,
                chaos: Some(seed),
                ..CpuDeviceConfig::default()
            })
            .unwrap(),
        );
        let (input, host, [a, b]) = program_rig(&device);
        let got = upload_gelu_download(&device, &host, a, b);
        let mut want = vec![0.0; N];
        ops::gelu_forward(&Cpu::default(), &mut want, &input);
        assert_eq!(got, want, "seed {seed}");
    }
}
