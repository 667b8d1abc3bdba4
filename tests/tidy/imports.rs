//! Which files use names from which, inside each crate, and the cycles among them.
//!
//! A file uses a name from another when a path in its non-test code (a `use`, or a path
//! such as `super::Foo` or `plan::Extent` in code) resolves to an item defined in the
//! other: each path is walked from the module it is written in through `crate`, `super`,
//! `self`, child modules and `use` bindings (re-exports followed to where the item is
//! defined) until it reaches an item; a path that leaves the crate is not followed, and a
//! path that ends at a module names no item. A glob (`use x::*`) counts as using the
//! module it empties. Test code does not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use super::source::{Crate, Workspace};

/// Where a path leads.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Target {
    /// A module of the crate.
    Module(usize),
    /// An item defined in a module of the crate.
    Item(usize),
}

/// Bounds the walk through `use` bindings (re-exports of re-exports).
const MAX_DEPTH: usize = 16;

/// Resolves `path` written in module `from`.
fn resolve(krate: &Crate, from: usize, path: &[String], depth: usize) -> Option<Target> {
    if depth > MAX_DEPTH || path.is_empty() {
        return None;
    }
    let mut at = Target::Module(from);
    for (i, seg) in path.iter().enumerate() {
        let Target::Module(m) = at else {
            // Past an item (an enum's variant, an associated item): the item is the name.
            return Some(at);
        };
        let first = i == 0;
        at = step(krate, m, seg, first, depth)?;
    }
    Some(at)
}

/// One segment `seg` from module `m`.
fn step(krate: &Crate, m: usize, seg: &str, first: bool, depth: usize) -> Option<Target> {
    let module = &krate.modules[m];
    match seg {
        "crate" if first => return Some(Target::Module(0)),
        "self" => return Some(Target::Module(m)),
        "super" => return module.parent.map(Target::Module),
        "*" => return Some(Target::Module(m)),
        _ => {}
    }
    if let Some(&child) = module.children.get(seg) {
        return Some(Target::Module(child));
    }
    if module.items.contains_key(seg) {
        return Some(Target::Item(m));
    }
    if let Some(bound) = module.uses.get(seg) {
        return resolve(krate, m, bound, depth + 1);
    }
    module
        .globs
        .iter()
        .find_map(|g| match resolve(krate, m, g, depth + 1) {
            Some(Target::Module(gm)) if gm != m => step(krate, gm, seg, false, depth + 1),
            _ => None,
        })
}

/// For each file, the files it uses names from (other than itself), over every crate;
/// with `reexports`, a `pub use` counts as a use.
pub fn file_edges(ws: &Workspace, reexports: bool) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for krate in &ws.crates {
        for (m, module) in krate.modules.iter().enumerate() {
            if module.test {
                continue;
            }
            for (path, export) in &module.paths {
                if *export && !reexports {
                    continue;
                }
                let target = match resolve(krate, m, path, 0) {
                    Some(Target::Item(t)) => t,
                    // A glob uses the module it empties.
                    Some(Target::Module(t)) if path.last().is_some_and(|s| s == "*") => t,
                    _ => continue,
                };
                let to = &krate.modules[target].file;
                if *to != module.file && !krate.modules[target].test {
                    edges
                        .entry(module.file.clone())
                        .or_default()
                        .insert(to.clone());
                }
            }
        }
    }
    edges
}

/// The strongly connected components of more than one file (Tarjan's algorithm), each
/// sorted, in order of their first file.
pub fn cycles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    let nodes: Vec<&PathBuf> = edges
        .iter()
        .flat_map(|(a, bs)| std::iter::once(a).chain(bs))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let index_of: BTreeMap<&PathBuf, usize> =
        nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let adj: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| {
            edges
                .get(*n)
                .map(|s| s.iter().map(|t| index_of[t]).collect())
                .unwrap_or_default()
        })
        .collect();
    let mut t = Tarjan::new(adj.len());
    for v in 0..adj.len() {
        if t.index[v].is_none() {
            t.visit(v, &adj);
        }
    }
    let mut out: Vec<Vec<PathBuf>> = t
        .components
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut files: Vec<PathBuf> = c.into_iter().map(|i| nodes[i].clone()).collect();
            files.sort();
            files
        })
        .collect();
    out.sort();
    out
}

struct Tarjan {
    next: usize,
    index: Vec<Option<usize>>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    components: Vec<Vec<usize>>,
}

impl Tarjan {
    fn new(n: usize) -> Self {
        Tarjan {
            next: 0,
            index: vec![None; n],
            low: vec![0; n],
            on_stack: vec![false; n],
            stack: Vec::new(),
            components: Vec::new(),
        }
    }

    fn visit(&mut self, v: usize, adj: &[Vec<usize>]) {
        self.index[v] = Some(self.next);
        self.low[v] = self.next;
        self.next += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
        for &w in &adj[v] {
            match self.index[w] {
                None => {
                    self.visit(w, adj);
                    self.low[v] = self.low[v].min(self.low[w]);
                }
                Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(self.low[v]) == self.index[v] {
            let mut component = Vec::new();
            loop {
                let w = self.stack.pop().unwrap();
                self.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            self.components.push(component);
        }
    }
}

/// The pairs of files that use names from each other directly (the cycles of two), for
/// messages.
pub fn mutual_pairs(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<(PathBuf, PathBuf)> {
    let mut pairs = Vec::new();
    for (a, bs) in edges {
        for b in bs {
            if a < b && edges.get(b).is_some_and(|s| s.contains(a)) {
                pairs.push((a.clone(), b.clone()));
            }
        }
    }
    pairs
}
