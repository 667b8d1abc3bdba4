//! What the tidy checks measure in a file: its functions' lengths, whether it writes
//! `unsafe`, and the string literals of its non-test code.

use proc_macro2::{Delimiter, TokenStream, TokenTree};

use super::source::{File, is_test};

/// A function of non-test code and its length.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Function {
    /// Lines from `fn` to the closing brace.
    pub lines: usize,
    /// `file:Type::name` (or `file:name` for a free function).
    pub key: String,
}

/// Every function with a body in `file`'s non-test code.
pub fn functions(file: &File) -> Vec<Function> {
    if file.test {
        return Vec::new();
    }
    let mut v = FnVisitor {
        file: file.path.display().to_string(),
        owner: Vec::new(),
        out: Vec::new(),
    };
    syn::visit::Visit::visit_file(&mut v, &file.ast);
    v.out
}

struct FnVisitor {
    file: String,
    owner: Vec<String>,
    out: Vec<Function>,
}

impl FnVisitor {
    fn push(&mut self, name: &syn::Ident, fn_token: &syn::token::Fn, block: &syn::Block) {
        let start = fn_token.span.start().line;
        let end = block.brace_token.span.close().end().line;
        let owner = self
            .owner
            .last()
            .map(|o| format!("{o}::"))
            .unwrap_or_default();
        self.out.push(Function {
            lines: end - start + 1,
            key: format!("{}:{owner}{name}", self.file),
        });
    }
}

impl<'ast> syn::visit::Visit<'ast> for FnVisitor {
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if is_test(&f.attrs) {
            return;
        }
        self.push(&f.sig.ident, &f.sig.fn_token, &f.block);
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if is_test(&f.attrs) {
            return;
        }
        self.push(&f.sig.ident, &f.sig.fn_token, &f.block);
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let Some(block) = &f.default {
            self.push(&f.sig.ident, &f.sig.fn_token, block);
        }
        syn::visit::visit_trait_item_fn(self, f);
    }

    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        if is_test(&i.attrs) {
            return;
        }
        let owner = match &*i.self_ty {
            syn::Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
            _ => None,
        };
        self.owner.push(owner.unwrap_or_else(|| "impl".into()));
        syn::visit::visit_item_impl(self, i);
        self.owner.pop();
    }

    fn visit_item_trait(&mut self, t: &'ast syn::ItemTrait) {
        self.owner.push(t.ident.to_string());
        syn::visit::visit_item_trait(self, t);
        self.owner.pop();
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_test(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }
}

/// The file's tokens (comments are not tokens; doc comments are `#[doc = ...]`).
fn tokens(file: &File) -> TokenStream {
    file.text
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e:?}", file.path.display()))
}

/// Whether the file writes the keyword `unsafe` anywhere, test code included.
pub fn writes_unsafe(file: &File) -> bool {
    fn walk(ts: TokenStream) -> bool {
        ts.into_iter().any(|t| match t {
            TokenTree::Ident(i) => i == "unsafe",
            TokenTree::Group(g) => walk(g.stream()),
            _ => false,
        })
    }
    walk(tokens(file))
}

/// The string literals of the file's non-test code, doc comments excepted, each with its
/// line.
pub fn string_literals(file: &File) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    walk_literals(tokens(file), file, &mut out);
    out
}

fn walk_literals(ts: TokenStream, file: &File, out: &mut Vec<(usize, String)>) {
    for t in ts {
        match t {
            TokenTree::Group(g) => {
                if g.delimiter() == Delimiter::Bracket && is_doc(&g.stream()) {
                    continue;
                }
                walk_literals(g.stream(), file, out);
            }
            TokenTree::Literal(l) => {
                let line = l.span().start().line;
                let text = l.to_string();
                let is_str =
                    text.starts_with('"') || text.starts_with("r\"") || text.starts_with("r#");
                if is_str && !file.is_test_line(line) {
                    out.push((line, text));
                }
            }
            _ => {}
        }
    }
}

/// Whether an attribute's tokens are `doc = ...`.
fn is_doc(ts: &TokenStream) -> bool {
    matches!(ts.clone().into_iter().next(), Some(TokenTree::Ident(i)) if i == "doc")
}

/// Lines of a file.
pub fn line_count(file: &File) -> usize {
    file.text.lines().count()
}
