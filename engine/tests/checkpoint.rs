//! Training checkpoints: a bit-exact round trip, pruning, one clear error per kind of
//! damage, and a save killed midway (for real, in a child process) that leaves the
//! previous checkpoint loadable.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use strata_engine::checkpoint::{
    self, Checkpoint, MANIFEST_FILE, OPTIMIZER_FILE, STATE_FILE, TrainerState, dir_name,
};
use strata_engine::model::weights::{self, CONFIG_FILE, WEIGHTS_FILE};
use strata_engine::model::{Gpt2Config, Model};

/// One buffer per block of `model`, every tensor element an arbitrary bit pattern
/// (NaNs with payloads, infinities, subnormals, -0.0 included), every alignment gap zero.
fn arbitrary_buffers(model: &Model, seed: u64) -> Vec<Vec<f32>> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut buffers = model.zero_params();
    for (block, buffer) in model.blocks().iter().zip(&mut buffers) {
        for t in &block.tensors {
            for x in &mut buffer[t.slot.range()] {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *x = f32::from_bits((state >> 32) as u32);
            }
        }
    }
    buffers
}

fn checkpoint_of(config: Gpt2Config, step: u64) -> Checkpoint {
    let model = Model::new(config).unwrap();
    let params = arbitrary_buffers(&model, 3 * step);
    let m = arbitrary_buffers(&model, 3 * step + 1);
    let v = arbitrary_buffers(&model, 3 * step + 2);
    Checkpoint {
        model,
        params,
        m,
        v,
        state: TrainerState {
            step,
            data_position: 7 * step + 3,
            rng: 0xdead_beef_0000_0000 ^ step,
            loss_scale: 65536.0 / (step + 1) as f32,
            good_steps: step % 5,
            skipped_steps: 2,
            config: json!({"lr": 3e-4, "betas": [0.9, 0.95], "model": "tiny", "step": step}),
        },
    }
}

fn tiny(step: u64) -> Checkpoint {
    checkpoint_of(Gpt2Config::tiny(), step)
}

fn assert_bits_equal(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    assert_eq!(a.len(), b.len(), "{what}: block count");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: block {i} length");
        if let Some(j) = (0..x.len()).find(|&j| x[j].to_bits() != y[j].to_bits()) {
            panic!("{what}: block {i} element {j}: {:?} != {:?}", x[j], y[j]);
        }
    }
}

fn assert_same(a: &Checkpoint, b: &Checkpoint) {
    assert_eq!(a.model, b.model);
    assert_bits_equal("params", &a.params, &b.params);
    assert_bits_equal("m", &a.m, &b.m);
    assert_bits_equal("v", &a.v, &b.v);
    assert_eq!(a.state, b.state);
    assert_eq!(a.state.loss_scale.to_bits(), b.state.loss_scale.to_bits());
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[test]
fn round_trip_is_bit_exact_on_tiny_and_an_odd_shape() {
    // The odd shape (width 9, 3 heads, vocabulary 7, context 5) leaves alignment gaps
    // after every tensor.
    for config in [Gpt2Config::tiny(), Gpt2Config::new(3, 3, 9, 7, 5)] {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("run");
        let ckpt = checkpoint_of(config, 12);
        let saved = checkpoint::save(&root, &ckpt, 2).unwrap();
        assert_eq!(saved, root.join("step-00000012"));
        assert_eq!(
            names_in(&root),
            ["step-00000012"],
            "no temporary folder left"
        );
        assert_eq!(
            names_in(&saved),
            [
                CONFIG_FILE,
                MANIFEST_FILE,
                WEIGHTS_FILE,
                OPTIMIZER_FILE,
                STATE_FILE
            ]
        );
        assert_same(&checkpoint::load(&saved).unwrap(), &ckpt);
        assert_same(&checkpoint::load(&root).unwrap(), &ckpt);
        assert_eq!(checkpoint::list(&root).unwrap(), [(12, saved.clone())]);
        assert_eq!(checkpoint::latest(&root).unwrap(), Some(saved.clone()));

        // The optimizer file holds f32 moments under Hugging Face names.
        let bytes = std::fs::read(saved.join(OPTIMIZER_FILE)).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tensors = ckpt
            .model
            .blocks()
            .iter()
            .map(|b| b.tensors.len())
            .sum::<usize>();
        assert_eq!(file.len(), 2 * tensors);
        let wpe = file.tensor("exp_avg_sq.transformer.wpe.weight").unwrap();
        assert_eq!(wpe.dtype(), safetensors::Dtype::F32);
        assert_eq!(wpe.shape(), [config.ctx, config.width]);
        assert!(file.tensor("exp_avg.transformer.h.0.mlp.c_fc.bias").is_ok());
    }
}

#[test]
fn model_files_load_through_load_pretrained() {
    let dir = tempfile::tempdir().unwrap();
    let mut ckpt = tiny(4);
    // load_pretrained refuses weights holding NaN or inf, which arbitrary bits hold.
    for x in ckpt.params.iter_mut().flatten() {
        if !x.is_finite() {
            *x = 0.0;
        }
    }
    let saved = checkpoint::save(dir.path(), &ckpt, 1).unwrap();
    let (model, params) = weights::load_pretrained(&saved).unwrap();
    assert_eq!(model, ckpt.model);
    assert_bits_equal("params", &params, &ckpt.params);
    assert_eq!(
        weights::load_config(&saved.join(CONFIG_FILE)).unwrap(),
        Model::new(Gpt2Config::tiny()).unwrap()
    );
}

#[test]
fn keep_last_prunes_older_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let steps = |root: &Path| -> Vec<u64> {
        checkpoint::list(root)
            .unwrap()
            .into_iter()
            .map(|(s, _)| s)
            .collect()
    };
    for step in 1..=5 {
        checkpoint::save(root, &tiny(step), 2).unwrap();
    }
    assert_eq!(steps(root), [4, 5]);
    checkpoint::save(root, &tiny(6), 3).unwrap();
    assert_eq!(steps(root), [4, 5, 6]);
    assert_eq!(names_in(root).len(), 3, "{:?}", names_in(root));

    let message = checkpoint::save(root, &tiny(7), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(message.contains("keep_last is 0"), "{message}");
    assert_eq!(steps(root), [4, 5, 6]);

    // Saving a step from an earlier run replaces it.
    let mut again = tiny(5);
    again.state.data_position = 999;
    checkpoint::save(root, &again, 3).unwrap();
    assert_same(&checkpoint::load(&root.join(dir_name(5))).unwrap(), &again);
    assert_eq!(names_in(root).len(), 3, "{:?}", names_in(root));

    // A run resumed from an earlier step keeps what it just saved and the later steps
    // of the earlier run (loading the root picks the latest of those).
    checkpoint::save(root, &tiny(2), 1).unwrap();
    assert_eq!(steps(root), [2, 4, 5, 6]);
    assert_eq!(checkpoint::load(root).unwrap().state.step, 6);
}

#[test]
fn bad_input_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let mut short = tiny(1);
    short.v.pop();
    let message = checkpoint::save(&root, &short, 1)
        .err()
        .unwrap()
        .to_string();
    assert_contains(&message, &["3 exp_avg_sq buffers given for 4 blocks"]);
    let mut overflowed = tiny(1);
    overflowed.state.loss_scale = f32::NAN;
    let message = checkpoint::save(&root, &overflowed, 1)
        .err()
        .unwrap()
        .to_string();
    assert_contains(&message, &["the loss scale is NaN"]);
    assert!(!root.exists());
}

#[test]
#[should_panic(expected = "m: block Transformer { layer: 0 } has a nonzero alignment gap")]
fn a_nonzero_alignment_gap_is_a_broken_invariant() {
    let dir = tempfile::tempdir().unwrap();
    let mut ckpt = checkpoint_of(Gpt2Config::new(3, 3, 9, 7, 5), 1);
    let end = ckpt.model.blocks()[1].tensors[0].slot.range().end;
    ckpt.m[1][end] = 1.0;
    let _ = checkpoint::save(dir.path(), &ckpt, 1);
}

/// A root with the checkpoints of steps 1 and 2; returns the folder of step 2.
fn two_checkpoints(root: &Path) -> PathBuf {
    checkpoint::save(root, &tiny(1), 2).unwrap();
    checkpoint::save(root, &tiny(2), 2).unwrap()
}

/// Records `file`'s present length and crc32c in the manifest, as if it had been written
/// so: what lets a test reach the checks behind the checksum.
fn reseal(dir: &Path, file: &str) {
    let path = dir.join(MANIFEST_FILE);
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join(file)).unwrap();
    manifest["files"][file] =
        json!({"len_bytes": bytes.len(), "crc32c": strata_storage::crc::crc32c(&bytes)});
    std::fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
}

/// The error loading `dir`, checked to be one line that names `dir`.
fn load_error(dir: &Path) -> String {
    let message = checkpoint::load(dir)
        .err()
        .expect("loading fails")
        .to_string();
    assert!(!message.contains('\n'), "one line: {message}");
    assert!(
        message.contains(&dir.display().to_string()),
        "names {}: {message}",
        dir.display()
    );
    message
}

fn assert_contains(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "`{part}` missing from: {message}");
    }
}

#[test]
fn a_flipped_byte_is_a_checksum_error_also_when_loading_the_root() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let newest = two_checkpoints(root);
    let path = newest.join(OPTIMIZER_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    let earlier = root.join(dir_name(1)).display().to_string();
    for target in [&newest, root] {
        let message = load_error(target);
        assert_contains(
            &message,
            &[
                &format!("checkpoint {} is corrupted", newest.display()),
                "optimizer.safetensors crc32c 0x",
                "!= manifest 0x",
                &format!("resume from the earlier checkpoint {earlier}"),
            ],
        );
    }
}

#[test]
fn a_truncated_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let newest = two_checkpoints(dir.path());
    let path = newest.join(WEIGHTS_FILE);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let message = load_error(&newest);
    assert_contains(
        &message,
        &[
            "model.safetensors is truncated",
            &format!("{} bytes where the manifest says {len}", len - 100),
        ],
    );

    // A file that grew is named too.
    let path = newest.join(STATE_FILE);
    let mut text = std::fs::read(&path).unwrap();
    text.push(b'\n');
    std::fs::write(&path, &text).unwrap();
    std::fs::copy(
        dir.path().join(dir_name(1)).join(WEIGHTS_FILE),
        newest.join(WEIGHTS_FILE),
    )
    .unwrap();
    reseal(&newest, WEIGHTS_FILE);
    let message = load_error(&newest);
    assert_contains(
        &message,
        &["trainer_state.json is too long", "where the manifest says"],
    );
}

#[test]
fn a_missing_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let newest = two_checkpoints(dir.path());
    std::fs::remove_file(newest.join(STATE_FILE)).unwrap();
    let message = load_error(&newest);
    assert_contains(
        &message,
        &[
            "is incomplete: trainer_state.json is missing",
            "resume from the earlier checkpoint",
        ],
    );
}

#[test]
fn a_missing_manifest_makes_a_folder_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let newest = two_checkpoints(root);
    std::fs::remove_file(newest.join(MANIFEST_FILE)).unwrap();
    let message = load_error(&newest);
    assert_contains(&message, &["manifest.json is missing"]);
    // A folder without a manifest is not a complete checkpoint: the root's latest is
    // the one before it.
    assert_eq!(
        checkpoint::latest(root).unwrap(),
        Some(root.join(dir_name(1)))
    );
    assert_eq!(checkpoint::load(root).unwrap().state.step, 1);
}

#[test]
fn a_config_that_disagrees_with_the_tensors_is_a_shape_error() {
    let dir = tempfile::tempdir().unwrap();
    let newest = two_checkpoints(dir.path());
    let path = newest.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = text.replace("\"n_embd\": 32", "\"n_embd\": 64");
    assert_ne!(edited, text);
    std::fs::write(&path, edited).unwrap();
    // Edited behind the manifest's back (same length): the checksum catches it first.
    assert_contains(&load_error(&newest), &["config.json crc32c"]);
    reseal(&newest, CONFIG_FILE);
    let message = load_error(&newest);
    assert_contains(
        &message,
        &[
            "model.safetensors tensor `transformer.wte.weight` has shape [64, 32]",
            "config.json implies [64, 64]",
        ],
    );
}

#[test]
fn bad_json_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let newest = two_checkpoints(dir.path());
    let state = newest.join(STATE_FILE);
    std::fs::write(&state, b"{\"step\": 2, \"rng\": ").unwrap();
    reseal(&newest, STATE_FILE);
    assert_contains(
        &load_error(&newest),
        &["is corrupted: trainer_state.json is not valid"],
    );

    std::fs::write(newest.join(MANIFEST_FILE), b"{\"format_version\": 1, \"st").unwrap();
    assert_contains(
        &load_error(&newest),
        &["is corrupted: manifest.json is not valid"],
    );
}

#[test]
fn another_format_version_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let newest = two_checkpoints(dir.path());
    let path = newest.join(MANIFEST_FILE);
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    manifest["format_version"] = json!(99);
    std::fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    assert_contains(
        &load_error(&newest),
        &["has format version 99, this strata reads version 1"],
    );
}

#[test]
fn a_folder_renamed_to_another_step_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let newest = two_checkpoints(dir.path());
    let renamed = dir.path().join(dir_name(3));
    std::fs::rename(&newest, &renamed).unwrap();
    assert_contains(
        &load_error(&renamed),
        &["manifest.json says step 2, the folder's name step 3"],
    );
}

#[test]
fn missing_and_empty_roots_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("nowhere");
    assert_contains(&load_error(&absent), &["does not exist"]);
    assert!(checkpoint::list(&absent).is_err());

    let root = dir.path().join("empty");
    std::fs::create_dir(&root).unwrap();
    assert_contains(&load_error(&root), &["holds no complete checkpoint"]);
    assert_eq!(checkpoint::latest(&root).unwrap(), None);

    std::fs::create_dir(root.join(".step-00000003.tmp-4194305")).unwrap();
    std::fs::create_dir(root.join("step-00000004")).unwrap();
    assert_contains(
        &load_error(&root),
        &[
            "holds no complete checkpoint",
            ".step-00000003.tmp-4194305 is an unfinished save",
            "step-00000004 has no manifest.json",
        ],
    );
}

/// Set in a child process of the kill tests: the root it saves into.
const CHILD_ROOT_VAR: &str = "STRATA_CHECKPOINT_TEST_CHILD_ROOT";
/// How long a child goes on saving if nobody kills it: far longer than a parent waits
/// (a count of saves was not: on an idle machine a child finished 20 small saves before
/// the parent's kill), and a bound, so a child whose parent died does not run forever.
const CHILD_SECONDS_MAX: u64 = 120;

/// A checkpoint large enough (5M parameters, 60 MB) that saving it takes a while.
fn large(step: u64) -> Checkpoint {
    checkpoint_of(Gpt2Config::new(1, 4, 256, 16384, 64), step)
}

/// In a child process (this test binary run again for one test, with `CHILD_ROOT_VAR`
/// set): resumes the run in the root like a trainer would, checking the checkpoint it
/// resumes from, and saves `make(step)` for the following steps until killed. Returns
/// false in the parent.
fn run_as_child(make: fn(u64) -> Checkpoint) -> bool {
    let Some(root) = std::env::var_os(CHILD_ROOT_VAR) else {
        return false;
    };
    let root = PathBuf::from(root);
    let start = match checkpoint::latest(&root) {
        Ok(Some(_)) => {
            let resumed = checkpoint::load(&root).unwrap();
            assert_same(&resumed, &make(resumed.state.step));
            resumed.state.step + 1
        }
        _ => 1,
    };
    let started = Instant::now();
    for step in start.. {
        if started.elapsed().as_secs() >= CHILD_SECONDS_MAX {
            break;
        }
        checkpoint::save(&root, &make(step), 2).unwrap();
    }
    true
}

/// Runs test `test` of this binary in a child process saving into `root`, its output
/// going to `log`.
fn spawn_child(test: &str, root: &Path, log: &Path) -> std::process::Child {
    let log = std::fs::File::create(log).unwrap();
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_ROOT_VAR, root)
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap()
}

/// SIGKILLs `child` (no destructor, no cleanup runs) and checks it died of it.
fn kill(mut child: std::process::Child, log: &Path) {
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "the child was killed, not done ({status}): {}",
        std::fs::read_to_string(log).unwrap()
    );
}

/// Polls `done` until it holds; fails after five minutes with the child's `log`.
fn wait_for(what: &str, log: &Path, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "waited in vain for {what}: {}",
            std::fs::read_to_string(log).unwrap()
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Whether folder `dir` exists and holds a file with bytes in it.
fn holds_bytes(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .filter_map(Result::ok)
            .any(|e| e.metadata().is_ok_and(|m| m.len() > 0))
    })
}

/// Checks that `root` loads as its latest complete checkpoint, `make` of its step, and
/// that a save of the next step succeeds and removes every hidden folder a killed save
/// left. Returns the step it found.
fn resume_and_save(root: &Path, make: fn(u64) -> Checkpoint) -> u64 {
    let (latest, _) = *checkpoint::list(root).unwrap().last().unwrap();
    let previous = make(latest);
    assert_same(&checkpoint::load(root).unwrap(), &previous);
    drop(previous);
    let next = make(latest + 1);
    checkpoint::save(root, &next, 2).unwrap();
    let names = names_in(root);
    assert!(
        names.iter().all(|n| n.starts_with("step-")),
        "nothing hidden is left: {names:?}"
    );
    assert_eq!(names.last(), Some(&dir_name(latest + 1)));
    assert_same(&checkpoint::load(root).unwrap(), &next);
    latest
}

#[test]
fn a_save_killed_midway_leaves_the_previous_checkpoint_loadable() {
    // The child saves checkpoints 1, 2, 3, ...; the parent kills it once checkpoint 2
    // has begun. Saving on past 2 keeps the test free of a race: a parent slow to kill
    // still finds the child in the middle of some save, and checks the one before.
    if run_as_child(large) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let log = dir.path().join("child.log");
    let child = spawn_child(
        "a_save_killed_midway_leaves_the_previous_checkpoint_loadable",
        &root,
        &log,
    );
    let tmp = root.join(format!(".step-00000002.tmp-{}", child.id()));
    wait_for("checkpoint 2 to begin", &log, || holds_bytes(&tmp));
    kill(child, &log);
    let latest = checkpoint::list(&root).unwrap().last().unwrap().0;
    println!("killed while saving after checkpoint {latest}");
    if latest == 1 {
        assert!(tmp.exists(), "the killed save leaves its temporary folder");
        assert!(!root.join(dir_name(2)).exists());
    }
    // Checkpoint 1 (or whichever is latest) loads intact; the resumed run's next save
    // succeeds and removes the stale temporary folder.
    resume_and_save(&root, large);
    assert!(!tmp.exists(), "the stale temporary folder is removed");
}

#[test]
fn kills_at_any_moment_leave_the_latest_checkpoint_loadable() {
    // Kills after delays from none to more than two saves' time land in every phase of
    // a save: writing, flushing, renaming, pruning. Each round's child resumes
    // from what the last one left.
    if run_as_child(tiny) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let log = dir.path().join("child.log");
    let latest_step = |root: &Path| {
        checkpoint::list(root)
            .ok()
            .and_then(|l| l.last().map(|(s, _)| *s))
            .unwrap_or(0)
    };
    // How long one save takes here, to spread the kills over a save's phases.
    let started = Instant::now();
    checkpoint::save(&dir.path().join("timing"), &tiny(1), 1).unwrap();
    let save_time = started.elapsed();
    let mut saved = 0; // the step the parent saved last
    for round in 0..8u64 {
        let child = spawn_child(
            "kills_at_any_moment_leave_the_latest_checkpoint_loadable",
            &root,
            &log,
        );
        // Wait for this round's child to save once, then a little more.
        wait_for("the child to save", &log, || latest_step(&root) > saved);
        std::thread::sleep(save_time * round as u32 / 3);
        kill(child, &log);
        let latest = resume_and_save(&root, tiny);
        println!(
            "round {round}: the child saved {} checkpoints before it was killed",
            latest - saved
        );
        saved = latest + 1;
    }
}
