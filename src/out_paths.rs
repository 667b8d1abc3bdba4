//! Where a run may write its trained model ([`out_refusal`]): never into the model folder
//! it trains from (a user fine-tuning a downloaded model would lose it), nor the
//! checkpoint folder or a swap folder itself, and never over a model saved before unless
//! the run says so.
//! Checked with the settings, before anything is read or allocated.
//!
//! Not here: writing the model (the engine's `model::weights`) or the free space it
//! needs (`train::preflight`).

use std::path::{Component, Path, PathBuf};

use strata_engine::model::weights;

/// `path` made absolute with its links resolved, as far as it exists (the rest, not made
/// yet, appended as written): two names of one folder compare equal.
pub fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let parts: Vec<Component> = absolute.components().collect();
    // The longest beginning of the path that exists, resolved; the rest as written.
    for split in (1..=parts.len()).rev() {
        let Ok(mut out) = parts[..split].iter().collect::<PathBuf>().canonicalize() else {
            continue;
        };
        for part in &parts[split..] {
            match part {
                Component::ParentDir => {
                    out.pop();
                }
                Component::CurDir => {}
                other => out.push(other),
            }
        }
        return out;
    }
    absolute
}

/// Why `--out` may not be `out`, in words that follow the flag: the input model folder
/// `model` (or a folder inside it), the `checkpoint_dir` or an `nvme` folder (a folder
/// inside those is fine: their files are named apart), a file, or a folder holding a model already (`config.json` or weights) unless
/// `overwrite`.
pub fn out_refusal(
    out: &Path,
    model: &str,
    checkpoint_dir: Option<&Path>,
    nvme: &[PathBuf],
    overwrite: bool,
) -> Option<String> {
    let target = resolved(out);
    let shown = out.display();
    let model_dir = Path::new(model);
    if model_dir.is_dir() && target.starts_with(resolved(model_dir)) {
        return Some(format!(
            "names {shown}, {} the model folder --model {model}: saving there would replace \
             the weights being trained from; name another directory",
            if target == resolved(model_dir) {
                "which is"
            } else {
                "inside"
            }
        ));
    }
    let others = checkpoint_dir
        .map(|d| ("--checkpoint-dir", d))
        .into_iter()
        .chain(
            nvme.iter()
                .filter(|d| !d.to_string_lossy().contains("{rank}"))
                .map(|d| ("--nvme", d.as_path())),
        );
    for (flag, dir) in others {
        if target == resolved(dir) {
            return Some(format!(
                "names {shown}, which is {flag} {}: the model needs a folder of its own; name \
                 another directory",
                dir.display()
            ));
        }
    }
    if out.exists() && !out.is_dir() {
        return Some(format!("names {shown}, which is a file; name a directory"));
    }
    let mut held = weights::weights_files(out);
    if out.join(weights::CONFIG_FILE).is_file() {
        held.insert(0, weights::CONFIG_FILE.to_string());
    }
    if !held.is_empty() && !overwrite {
        return Some(format!(
            "names {shown}, which holds a model already ({}); add --overwrite to replace it, \
             or name another directory",
            held.join(", ")
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_name_of_a_folder_resolves_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir(&model).unwrap();
        let real = model.canonicalize().unwrap();
        assert_eq!(resolved(&dir.path().join("model/../model/.")), real);
        assert_eq!(resolved(&dir.path().join("model/new/../x")), real.join("x"));
        std::os::unix::fs::symlink(&model, dir.path().join("link")).unwrap();
        assert_eq!(resolved(&dir.path().join("link")), real);
        assert_eq!(resolved(&dir.path().join("link/sub")), real.join("sub"));
    }

    #[test]
    fn out_is_refused_in_the_model_checkpoint_and_swap_folders_and_over_a_model() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        for d in ["model", "ckpt", "nvme", "saved", "empty"] {
            std::fs::create_dir(p(d)).unwrap();
        }
        std::fs::write(p("model/config.json"), "{}").unwrap();
        std::fs::write(p("saved/model.safetensors"), "").unwrap();
        std::fs::write(p("file"), "").unwrap();
        let model = p("model");
        let model = model.to_str().unwrap();
        let refusal = |out: &Path, overwrite: bool| {
            out_refusal(out, model, Some(&p("ckpt")), &[p("nvme")], overwrite)
        };
        for (out, words) in [
            (p("model"), "which is the model folder --model"),
            (p("model/../model"), "which is the model folder --model"),
            (p("model/sub"), "inside the model folder --model"),
            (p("ckpt"), "which is --checkpoint-dir"),
            (p("nvme/."), "which is --nvme"),
            (p("file"), "which is a file"),
            (
                p("saved"),
                "holds a model already (model.safetensors); add --overwrite",
            ),
        ] {
            let why = refusal(&out, false).unwrap_or_default();
            assert!(why.contains(words), "{}: {why}", out.display());
        }
        // Even with --overwrite, never the input model.
        assert!(refusal(&p("model"), true).is_some());
        assert_eq!(refusal(&p("saved"), true), None);
        assert_eq!(refusal(&p("empty"), false), None);
        assert_eq!(refusal(&p("new/deeper"), false), None);
        // A checkpoint folder inside the output folder, or the other way round, is fine.
        assert_eq!(
            out_refusal(&p("empty"), model, Some(&p("empty/ckpt")), &[], false),
            None
        );
        assert_eq!(refusal(&p("nvme/out"), false), None);
    }
}
