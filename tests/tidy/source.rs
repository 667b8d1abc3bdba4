//! The workspace's Rust sources as the tidy checks see them: every crate's module tree
//! walked from its roots (libraries, binaries, benches, examples, tests), each module with
//! the file that holds it, whether it is test code, the names it defines and the `use`
//! bindings it makes; and for each file the line ranges of its test code.
//!
//! Not here: the checks themselves (`main.rs`) or import resolution (`imports.rs`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use syn::spanned::Spanned;

/// The workspace's crates, by folder (relative to the repository root).
pub const CRATES: [&str; 6] = [".", "storage", "kernels", "engine", "comm", "python"];

/// One module of a crate.
#[derive(Debug)]
pub struct Module {
    /// The file that holds it (an inline module shares its parent's).
    pub file: PathBuf,
    /// Whether it is test code (`#[cfg(test)]`, or a crate of `tests/`, or inside one).
    pub test: bool,
    /// The module it is declared in.
    pub parent: Option<usize>,
    /// Child modules, by name.
    pub children: BTreeMap<String, usize>,
    /// Names defined here (items other than modules).
    pub items: BTreeMap<String, ()>,
    /// Names bound by `use`, with the path each stands for.
    pub uses: BTreeMap<String, Vec<String>>,
    /// `use path::*` targets.
    pub globs: Vec<Vec<String>>,
    /// Every path written in its non-test code, `use` paths included (each a list of
    /// segments; a glob ends in `*`), and whether it is a re-export (`pub use`).
    pub paths: Vec<(Vec<String>, bool)>,
}

/// One parsed file.
pub struct File {
    /// Relative to the repository root.
    pub path: PathBuf,
    /// Its text.
    pub text: String,
    /// Its syntax tree.
    pub ast: syn::File,
    /// Whether the whole file is test code.
    pub test: bool,
    /// Inclusive line ranges of test code inside it (`#[cfg(test)]` or `#[test]` items).
    pub test_lines: Vec<(usize, usize)>,
}

impl File {
    /// Whether `line` is test code.
    pub fn is_test_line(&self, line: usize) -> bool {
        self.test || self.test_lines.iter().any(|&(a, b)| a <= line && line <= b)
    }
}

/// A crate's module tree; module 0 is its root.
#[derive(Debug, Default)]
pub struct Crate {
    /// Its modules.
    pub modules: Vec<Module>,
}

/// Every file and every crate (each library, binary, bench, example and test target is a
/// crate of its own).
#[derive(Default)]
pub struct Workspace {
    /// Files by relative path.
    pub files: BTreeMap<PathBuf, File>,
    /// Crates.
    pub crates: Vec<Crate>,
}

/// The repository root (this package's folder).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Reads the whole workspace.
pub fn workspace() -> Workspace {
    let mut ws = Workspace::default();
    for dir in CRATES {
        let base = if dir == "." { root() } else { root().join(dir) };
        for (root_file, test) in crate_roots(&base) {
            let mut krate = Crate::default();
            load_module(&mut ws, &mut krate, &root_file, None, test);
            ws.crates.push(krate);
        }
    }
    ws
}

/// The root files of a crate folder's targets, each with whether it is test code.
fn crate_roots(dir: &Path) -> Vec<(PathBuf, bool)> {
    let mut roots = Vec::new();
    for lib in ["src/lib.rs", "src/main.rs"] {
        if dir.join(lib).exists() {
            roots.push((dir.join(lib), false));
        }
    }
    for (sub, test) in [
        ("src/bin", false),
        ("benches", false),
        ("examples", false),
        ("tests", true),
    ] {
        let Ok(entries) = std::fs::read_dir(dir.join(sub)) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .collect();
        files.sort();
        roots.extend(files.into_iter().map(|p| (p, test)));
        // A target of several files: `tests/NAME/main.rs`.
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir.join(sub))
            .unwrap()
            .map(|e| e.unwrap().path().join("main.rs"))
            .filter(|p| p.exists())
            .collect();
        dirs.sort();
        roots.extend(dirs.into_iter().map(|p| (p, test)));
    }
    roots
}

/// Parses `path` as a module of `krate` declared in `parent`, and its children.
fn load_module(
    ws: &mut Workspace,
    krate: &mut Crate,
    path: &Path,
    parent: Option<usize>,
    test: bool,
) -> usize {
    let path = &normalize(path);
    let rel = path.strip_prefix(root()).unwrap_or(path).to_path_buf();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", rel.display()));
    let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", rel.display()));
    let items = ast.items.clone();
    ws.files.entry(rel.clone()).or_insert_with(|| File {
        path: rel.clone(),
        test_lines: test_lines(&ast.items),
        text,
        ast,
        test,
    });
    let index = new_module(krate, &rel, parent, test);
    let dir = child_dir(path);
    fill_module(ws, krate, index, &items, &dir);
    index
}

/// `path` with every `..` taken back lexically (as `#[path = "../../x.rs"]` writes).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

fn new_module(krate: &mut Crate, file: &Path, parent: Option<usize>, test: bool) -> usize {
    krate.modules.push(Module {
        file: file.to_path_buf(),
        test,
        parent,
        children: BTreeMap::new(),
        items: BTreeMap::new(),
        uses: BTreeMap::new(),
        globs: Vec::new(),
        paths: Vec::new(),
    });
    krate.modules.len() - 1
}

/// Where the files of `path`'s child modules live: beside it for `mod.rs`, `lib.rs`,
/// `main.rs` and a crate root of `tests/`, `benches/` or `examples/`; else in the folder of
/// its name.
fn child_dir(path: &Path) -> PathBuf {
    let name = path.file_stem().unwrap().to_str().unwrap();
    let parent = path.parent().unwrap();
    let in_target_dir = parent
        .file_name()
        .is_some_and(|d| ["tests", "benches", "examples", "bin"].contains(&d.to_str().unwrap()));
    if ["mod", "lib", "main"].contains(&name) || in_target_dir {
        parent.to_path_buf()
    } else {
        parent.join(name)
    }
}

/// Records `items` in module `index` (whose child files live in `dir`).
fn fill_module(
    ws: &mut Workspace,
    krate: &mut Crate,
    index: usize,
    items: &[syn::Item],
    dir: &Path,
) {
    let test = krate.modules[index].test;
    for item in items {
        let item_test = test || is_test(attrs_of(item));
        match item {
            syn::Item::Mod(m) => {
                let name = m.ident.to_string();
                let child = match &m.content {
                    Some((_, inner)) => {
                        let file = krate.modules[index].file.clone();
                        let child = new_module(krate, &file, Some(index), item_test);
                        fill_module(ws, krate, child, inner, &dir.join(&name));
                        child
                    }
                    None => {
                        let file = module_file(dir, &name, &m.attrs);
                        load_module(ws, krate, &file, Some(index), item_test)
                    }
                };
                krate.modules[index].children.insert(name, child);
            }
            syn::Item::Use(u) => {
                let export = !matches!(u.vis, syn::Visibility::Inherited);
                let module = &mut krate.modules[index];
                record_use(module, &u.tree, Vec::new(), (item_test, export));
            }
            other => {
                if let Some(name) = item_name(other) {
                    krate.modules[index].items.insert(name, ());
                }
                if !item_test {
                    let mut collect = PathCollector::default();
                    syn::visit::Visit::visit_item(&mut collect, other);
                    let paths = collect.paths.into_iter().map(|p| (p, false));
                    krate.modules[index].paths.extend(paths);
                }
            }
        }
    }
}

/// The file of `mod name;` declared with `attrs` whose children live in `dir`.
fn module_file(dir: &Path, name: &str, attrs: &[syn::Attribute]) -> PathBuf {
    for attr in attrs {
        if attr.path().is_ident("path")
            && let syn::Meta::NameValue(nv) = &attr.meta
            && let syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) = &nv.value
        {
            // `#[path]` is relative to the declaring file's folder, which for the crate
            // roots that use it is `dir`.
            return dir.join(s.value());
        }
    }
    let flat = dir.join(format!("{name}.rs"));
    if flat.exists() {
        flat
    } else {
        dir.join(name).join("mod.rs")
    }
}

/// Records a `use` tree under the prefix `prefix`; `how` says whether it is test code and
/// whether it is a re-export.
fn record_use(module: &mut Module, tree: &syn::UseTree, prefix: Vec<String>, how: (bool, bool)) {
    let joined = |last: String| {
        let mut p = prefix.clone();
        p.push(last);
        p
    };
    match tree {
        syn::UseTree::Path(p) => record_use(module, &p.tree, joined(p.ident.to_string()), how),
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            let path = if name == "self" {
                prefix.clone()
            } else {
                joined(name.clone())
            };
            let bound = if name == "self" {
                prefix.last().cloned().unwrap_or_default()
            } else {
                name
            };
            bind(module, bound, path, how);
        }
        syn::UseTree::Rename(r) => bind(
            module,
            r.rename.to_string(),
            joined(r.ident.to_string()),
            how,
        ),
        syn::UseTree::Glob(_) => {
            if !how.0 {
                module.globs.push(prefix.clone());
                module.paths.push((joined("*".into()), how.1));
            }
        }
        syn::UseTree::Group(g) => {
            for t in &g.items {
                record_use(module, t, prefix.clone(), how);
            }
        }
    }
}

fn bind(module: &mut Module, name: String, path: Vec<String>, (test, export): (bool, bool)) {
    if test {
        return;
    }
    module.paths.push((path.clone(), export));
    if name != "_" {
        module.uses.insert(name, path);
    }
}

/// Collects every multi-segment path of an item, skipping `#[cfg(test)]` parts.
#[derive(Default)]
struct PathCollector {
    paths: Vec<Vec<String>>,
}

impl<'ast> syn::visit::Visit<'ast> for PathCollector {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.segments.len() > 1 {
            self.paths
                .push(p.segments.iter().map(|s| s.ident.to_string()).collect());
        }
        syn::visit::visit_path(self, p);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test(&f.attrs) {
            syn::visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !is_test(&f.attrs) {
            syn::visit::visit_item_fn(self, f);
        }
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_test(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }

    fn visit_attribute(&mut self, _: &'ast syn::Attribute) {}
}

/// Whether attributes mark test code: `#[cfg(test)]` (alone or inside `all`), `#[test]`.
pub fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        if a.path().is_ident("test") {
            return true;
        }
        if !a.path().is_ident("cfg") {
            return false;
        }
        let text = a
            .meta
            .require_list()
            .map(|l| l.tokens.to_string())
            .unwrap_or_default();
        text == "test"
            || (text.starts_with("all") && text.contains("test") && !text.contains("not"))
    })
}

/// The attributes of any item.
pub fn attrs_of(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item::*;
    match item {
        Const(i) => &i.attrs,
        Enum(i) => &i.attrs,
        ExternCrate(i) => &i.attrs,
        Fn(i) => &i.attrs,
        ForeignMod(i) => &i.attrs,
        Impl(i) => &i.attrs,
        Macro(i) => &i.attrs,
        Mod(i) => &i.attrs,
        Static(i) => &i.attrs,
        Struct(i) => &i.attrs,
        Trait(i) => &i.attrs,
        TraitAlias(i) => &i.attrs,
        Type(i) => &i.attrs,
        Union(i) => &i.attrs,
        Use(i) => &i.attrs,
        _ => &[],
    }
}

/// The name an item defines in its module's namespace, if any.
fn item_name(item: &syn::Item) -> Option<String> {
    use syn::Item::*;
    Some(match item {
        Const(i) => i.ident.to_string(),
        Enum(i) => i.ident.to_string(),
        Fn(i) => i.sig.ident.to_string(),
        Static(i) => i.ident.to_string(),
        Struct(i) => i.ident.to_string(),
        Trait(i) => i.ident.to_string(),
        Type(i) => i.ident.to_string(),
        Union(i) => i.ident.to_string(),
        Macro(i) => i.ident.as_ref()?.to_string(),
        _ => return None,
    })
}

/// The inclusive line ranges of the test items among `items`, at any depth of inline
/// modules and impls.
fn test_lines(items: &[syn::Item]) -> Vec<(usize, usize)> {
    let mut ranges = Vec::new();
    for item in items {
        let span = item.span();
        if is_test(attrs_of(item)) {
            ranges.push((span.start().line, span.end().line));
            continue;
        }
        match item {
            syn::Item::Mod(m) => {
                if let Some((_, inner)) = &m.content {
                    ranges.extend(test_lines(inner));
                }
            }
            syn::Item::Impl(i) => {
                for f in &i.items {
                    if let syn::ImplItem::Fn(f) = f
                        && is_test(&f.attrs)
                    {
                        ranges.push((f.span().start().line, f.span().end().line));
                    }
                }
            }
            _ => {}
        }
    }
    ranges
}
