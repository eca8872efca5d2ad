//! The file-level import-cycle check of `cargo xtask lint`: no two files inside a crate's
//! `src/` may import each other, directly or through other files.
//!
//! Nodes are the module files of a crate (`foo.rs`, `foo/mod.rs`, `foo/bar.rs`), found by
//! following the `mod name;` declarations from the roots (`lib.rs`, `main.rs`, `bin/*.rs`,
//! `bin/*/main.rs`); `tests/`, `benches/` and `examples/` are other crates and out of scope.
//! An inline module (`#[cfg(test)] mod tests { … }`) belongs to the file that holds it.
//!
//! There is an edge `A -> B` when code of file `A` names an item through module `B`:
//!
//! * `use crate::b::…`, `crate::b::…` in a path, `self::b::…` and `super::b::…` (resolved
//!   from the module, inline modules included, that the path is written in), `b::…` where
//!   `b` is a child module declared in that scope, and `x::…` where a `use` of that scope
//!   binds `x` (`use crate::b; b::f()`);
//! * a path ends at the deepest module it walks through: `crate::b::c::Item` is an edge to
//!   `b/c.rs` when `c` is a module file, to `b.rs` when `c` is an item or an inline module
//!   of `b.rs`;
//! * a name at the crate root (`crate::Item`, `use crate::{Item}`, a child's `super::Item`
//!   from a root's child) resolves through the root's `use` declarations (`pub use b::Item`,
//!   `pub use b::*` when `b` defines `Item`) to the module that defines it; a name the root
//!   defines itself is an edge to the root file, a name it re-exports from another crate none.
//!
//! A parent's `mod child;` declaration is not an edge; a child's `super::item` is an edge to
//! its parent's file. Macros are not expanded and `#[path]` attributes are not read.
//!
//! Every cycle is reported as the list of files of one strongly connected component, with
//! one line per edge inside it (file, line and the path written there).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Crates whose import cycles are reported but not yet enforced; each leaves the list once
/// its files no longer import each other (the check then says so).
pub(crate) const CYCLE_CHECK_PENDING: &[&str] = &[];

/// Runs the check over the workspace members that have a `src/` folder.
pub(crate) fn check(workspace: &Path) -> Result<(), String> {
    let manifest = std::fs::read_to_string(workspace.join("Cargo.toml"))
        .map_err(|e| format!("cannot read the workspace Cargo.toml: {e}"))?;
    let table: toml::Table = manifest
        .parse()
        .map_err(|e| format!("cannot parse the workspace Cargo.toml: {e}"))?;
    let members: Vec<String> = table
        .get("workspace")
        .and_then(|w| w.get("members"))
        .and_then(|m| m.as_array())
        .map(|m| {
            m.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    for pending in CYCLE_CHECK_PENDING {
        if !members.iter().any(|m| m == pending) {
            return Err(format!(
                "CYCLE_CHECK_PENDING names {pending:?}, which is not a workspace member"
            ));
        }
    }
    let mut failures = Vec::new();
    for member in &members {
        let dir = workspace.join(member);
        if !dir.join("src").is_dir() {
            continue;
        }
        let cycles = crate_cycles(&dir)?;
        let pending = CYCLE_CHECK_PENDING.contains(&member.as_str());
        if cycles.is_empty() {
            if pending {
                failures.push(format!(
                    "{member} has no import cycle any more: remove it from CYCLE_CHECK_PENDING \
                     (xtask/src/cycles.rs)"
                ));
            } else {
                eprintln!("xtask: {member}: no import cycle between its files");
            }
            continue;
        }
        let report = format_cycles(member, &cycles);
        if pending {
            eprintln!(
                "xtask: {member}: {} import cycle(s), not enforced yet (CYCLE_CHECK_PENDING):",
                cycles.len()
            );
            eprintln!("{report}");
        } else {
            failures.push(report);
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "files import each other (move the helper to the file that owns it, or the shared \
             piece into its own module):\n{}",
            failures.join("\n")
        ))
    }
}

/// One strongly connected component of a crate's file graph with more than one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cycle {
    /// Its files, relative to the crate folder, sorted.
    pub files: Vec<String>,
    /// Its edges: (from, to, first place the path is written: `line: path`).
    pub edges: Vec<(String, String, String)>,
}

fn format_cycles(krate: &str, cycles: &[Cycle]) -> String {
    let mut out = String::new();
    for cycle in cycles {
        out.push_str(&format!(
            "  {krate}: cycle of {} files: {}\n",
            cycle.files.len(),
            cycle.files.join(", ")
        ));
        for (from, to, at) in &cycle.edges {
            out.push_str(&format!("    {from} -> {to} ({from}:{at})\n"));
        }
    }
    out.trim_end().to_owned()
}

/// The import cycles between the module files of the crate in `crate_dir`.
pub(crate) fn crate_cycles(crate_dir: &Path) -> Result<Vec<Cycle>, String> {
    let graph = Graph::build(crate_dir)?;
    Ok(graph.cycles())
}

// ---------------------------------------------------------------------------------------
// Lexing: identifiers, `::`, brackets and punctuation; comments and literals dropped.

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
    /// A string, char or number literal (its value is never needed).
    Literal,
    Lifetime,
}

fn lex(source: &str) -> Vec<(Tok, usize)> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let n = chars.len();
    let is_ident_start = |c: char| c.is_alphabetic() || c == '_';
    let is_ident_char = |c: char| c.is_alphanumeric() || c == '_';
    while i < n {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < n && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && chars.get(i + 1) == Some(&'*') {
            let mut depth = 0usize;
            while i < n {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == '"' {
            let start = line;
            i = skip_string(&chars, i + 1, &mut line);
            out.push((Tok::Literal, start));
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{…}') or a lifetime / label ('a).
            if chars.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < n && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
                out.push((Tok::Literal, line));
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push((Tok::Literal, line));
            } else {
                i += 1;
                while i < n && is_ident_char(chars[i]) {
                    i += 1;
                }
                out.push((Tok::Lifetime, line));
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < n && is_ident_char(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars.get(i).copied();
            let prefix = matches!(word.as_str(), "b" | "c" | "r" | "br" | "cr");
            if prefix && next == Some('"') {
                // b"…", c"…", r"…" (no escapes in raw strings, but none end early either).
                let start = line;
                i = if word.contains('r') {
                    skip_raw_string(&chars, i, 0, &mut line)
                } else {
                    skip_string(&chars, i + 1, &mut line)
                };
                out.push((Tok::Literal, start));
            } else if word.contains('r') && prefix && next == Some('#') {
                let mut hashes = 0;
                while chars.get(i + hashes) == Some(&'#') {
                    hashes += 1;
                }
                if chars.get(i + hashes) == Some(&'"') {
                    let start = line;
                    i = skip_raw_string(&chars, i + hashes, hashes, &mut line);
                    out.push((Tok::Literal, start));
                } else if word == "r" && chars.get(i + 1).is_some_and(|&c| is_ident_start(c)) {
                    // A raw identifier: r#name.
                    let start = i + 1;
                    i += 1;
                    while i < n && is_ident_char(chars[i]) {
                        i += 1;
                    }
                    out.push((Tok::Ident(chars[start..i].iter().collect()), line));
                } else {
                    out.push((Tok::Ident(word), line));
                }
            } else if word == "b" && next == Some('\'') {
                // A byte literal b'x' / b'\n'.
                i += 1;
                if chars.get(i) == Some(&'\\') {
                    i += 2;
                }
                while i < n && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
                out.push((Tok::Literal, line));
            } else {
                out.push((Tok::Ident(word), line));
            }
        } else if c.is_ascii_digit() {
            while i < n && is_ident_char(chars[i]) {
                i += 1;
            }
            out.push((Tok::Literal, line));
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push((Tok::PathSep, line));
            i += 2;
        } else {
            out.push((Tok::Punct(c), line));
            i += 1;
        }
    }
    out
}

/// Skips a string body from after its opening quote; returns the index after the closing one.
fn skip_string(chars: &[char], mut i: usize, line: &mut usize) -> usize {
    while i < chars.len() {
        match chars[i] {
            '\\' => {
                if chars.get(i + 1) == Some(&'\n') {
                    *line += 1;
                }
                i += 2;
            }
            '"' => return i + 1,
            '\n' => {
                *line += 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    i
}

/// Skips a raw string from its opening quote (index of `"`) with `hashes` `#`s.
fn skip_raw_string(chars: &[char], mut i: usize, hashes: usize, line: &mut usize) -> usize {
    i += 1;
    while i < chars.len() {
        if chars[i] == '"' && (0..hashes).all(|k| chars.get(i + 1 + k) == Some(&'#')) {
            return i + 1 + hashes;
        }
        if chars[i] == '\n' {
            *line += 1;
        }
        i += 1;
    }
    i
}

// ---------------------------------------------------------------------------------------
// Parsing one file: module declarations, `use` trees, paths and defined names, each with the
// inline-module scope (relative to the file's module) it is written in.

#[derive(Debug, Default)]
struct FileFacts {
    /// (scope, name, inline?) of each `mod name;` / `mod name { … }`.
    mods: Vec<(Vec<String>, String, bool)>,
    /// Paths that name items: (scope, segments, line, is the binding of a `use`).
    paths: Vec<PathRef>,
    /// Names of the items each scope defines (`fn`, `struct`, …, also methods: an
    /// over-approximation only used to resolve glob re-exports).
    defines: BTreeMap<Vec<String>, BTreeSet<String>>,
}

#[derive(Debug, Clone)]
struct PathRef {
    scope: Vec<String>,
    segments: Vec<String>,
    line: usize,
    /// For a `use` leaf: the name it binds (`None` for a glob), else `None`.
    binds: Option<String>,
    is_use: bool,
    glob: bool,
}

fn parse(source: &str) -> FileFacts {
    let toks = lex(source);
    let mut facts = FileFacts::default();
    // Inline module scopes: (scope path, brace depth inside it).
    let mut scopes: Vec<(Vec<String>, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut pending_mod: Option<String> = None;
    let current = |scopes: &Vec<(Vec<String>, usize)>| -> Vec<String> {
        scopes.last().map(|s| s.0.clone()).unwrap_or_default()
    };
    let ident = |k: usize| -> Option<&str> {
        match toks.get(k) {
            Some((Tok::Ident(s), _)) => Some(s.as_str()),
            _ => None,
        }
    };
    let is = |k: usize, t: &Tok| toks.get(k).map(|x| &x.0) == Some(t);
    let mut i = 0;
    while i < toks.len() {
        let (tok, line) = (&toks[i].0, toks[i].1);
        match tok {
            Tok::Punct('{') => {
                depth += 1;
                if let Some(name) = pending_mod.take() {
                    let mut scope = current(&scopes);
                    scope.push(name);
                    scopes.push((scope, depth));
                }
                i += 1;
            }
            Tok::Punct('}') => {
                if scopes.last().is_some_and(|s| s.1 == depth) {
                    scopes.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(word) if word == "mod" && !is(i.wrapping_sub(1), &Tok::PathSep) => {
                if let Some(name) = ident(i + 1) {
                    let scope = current(&scopes);
                    if is(i + 2, &Tok::Punct(';')) {
                        facts.mods.push((scope, name.to_owned(), false));
                    } else if is(i + 2, &Tok::Punct('{')) {
                        facts.mods.push((scope, name.to_owned(), true));
                        pending_mod = Some(name.to_owned());
                    }
                    facts
                        .defines
                        .entry(current(&scopes))
                        .or_default()
                        .insert(name.to_owned());
                }
                i += 2;
            }
            Tok::Ident(word)
                if word == "use"
                    && !is(i + 1, &Tok::Punct('<'))
                    && !is(i.wrapping_sub(1), &Tok::PathSep) =>
            {
                let scope = current(&scopes);
                let mut k = i + 1;
                let mut leaves = Vec::new();
                parse_use_tree(&toks, &mut k, Vec::new(), &mut leaves);
                for (segments, binds, glob) in leaves {
                    facts.paths.push(PathRef {
                        scope: scope.clone(),
                        segments,
                        line,
                        binds,
                        is_use: true,
                        glob,
                    });
                }
                // Up to the end of the declaration.
                while k < toks.len() && !is(k, &Tok::Punct(';')) {
                    k += 1;
                }
                i = k + 1;
            }
            Tok::Ident(word)
                if matches!(
                    word.as_str(),
                    "fn" | "struct" | "enum" | "trait" | "type" | "const" | "static" | "union"
                ) =>
            {
                if let Some(name) = ident(i + 1) {
                    facts
                        .defines
                        .entry(current(&scopes))
                        .or_default()
                        .insert(name.to_owned());
                }
                i += 1;
            }
            Tok::Ident(word) if !is(i.wrapping_sub(1), &Tok::PathSep) => {
                let keyword_path = matches!(word.as_str(), "crate" | "self" | "super");
                // `pub(in crate::x)` is a visibility, not a use of `x`.
                let visibility =
                    i >= 2 && ident(i - 1) == Some("in") && is(i - 2, &Tok::Punct('('));
                if (keyword_path || is(i + 1, &Tok::PathSep)) && !visibility {
                    let mut segments = vec![word.clone()];
                    let mut k = i + 1;
                    while is(k, &Tok::PathSep) {
                        match ident(k + 1) {
                            Some(next) => {
                                segments.push(next.to_owned());
                                k += 2;
                            }
                            None => break,
                        }
                    }
                    if segments.len() > 1 {
                        facts.paths.push(PathRef {
                            scope: current(&scopes),
                            segments,
                            line,
                            binds: None,
                            is_use: false,
                            glob: false,
                        });
                    }
                    i = k;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    facts
}

/// Parses a use tree at `toks[*k]` into leaves (segments, bound name, glob?). A leading `::`
/// (an extern crate path) is kept as a `::` segment.
fn parse_use_tree(
    toks: &[(Tok, usize)],
    k: &mut usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>, bool)>,
) {
    if prefix.is_empty() && toks.get(*k).map(|t| &t.0) == Some(&Tok::PathSep) {
        prefix.push("::".into());
        *k += 1;
    }
    loop {
        match toks.get(*k).map(|t| &t.0) {
            Some(Tok::Ident(name)) => {
                prefix.push(name.clone());
                *k += 1;
                if toks.get(*k).map(|t| &t.0) == Some(&Tok::PathSep) {
                    *k += 1;
                    continue;
                }
                // A leaf: `name` or `name as alias`; `self` inside a group names its prefix.
                let mut binds = name.clone();
                if name == "self" {
                    prefix.pop();
                    binds = prefix.last().cloned().unwrap_or_default();
                }
                if let Some((Tok::Ident(kw), _)) = toks.get(*k)
                    && kw == "as"
                {
                    if let Some((Tok::Ident(alias), _)) = toks.get(*k + 1) {
                        binds = alias.clone();
                    }
                    *k += 2;
                }
                out.push((prefix, Some(binds), false));
                return;
            }
            Some(Tok::Punct('*')) => {
                *k += 1;
                out.push((prefix, None, true));
                return;
            }
            Some(Tok::Punct('{')) => {
                *k += 1;
                loop {
                    match toks.get(*k).map(|t| &t.0) {
                        Some(Tok::Punct('}')) => {
                            *k += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *k += 1,
                        None | Some(Tok::Punct(';')) => return,
                        Some(_) => {
                            let before = *k;
                            parse_use_tree(toks, k, prefix.clone(), out);
                            if *k == before {
                                *k += 1;
                            }
                        }
                    }
                }
            }
            _ => return,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The module tree and the file graph.

struct Module {
    file: usize,
    /// Path of this module inside its file (empty for a file's own module).
    inline: Vec<String>,
}

struct Graph {
    /// Files, relative to the crate folder (`src/…`).
    files: Vec<String>,
    facts: Vec<FileFacts>,
    /// (root index, module path) → module.
    modules: HashMap<(usize, Vec<String>), Module>,
    /// (file) → (root index, module path of the file).
    file_module: Vec<(usize, Vec<String>)>,
}

impl Graph {
    fn build(crate_dir: &Path) -> Result<Self, String> {
        let src = crate_dir.join("src");
        let mut roots = Vec::new();
        for name in ["lib.rs", "main.rs"] {
            if src.join(name).is_file() {
                roots.push(src.join(name));
            }
        }
        if let Ok(entries) = std::fs::read_dir(src.join("bin")) {
            let mut bins: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter_map(|p| {
                    if p.is_dir() {
                        Some(p.join("main.rs")).filter(|m| m.is_file())
                    } else {
                        Some(p).filter(|p| p.extension().is_some_and(|e| e == "rs"))
                    }
                })
                .collect();
            bins.sort();
            roots.extend(bins);
        }
        let mut graph = Graph {
            files: Vec::new(),
            facts: Vec::new(),
            modules: HashMap::new(),
            file_module: Vec::new(),
        };
        let mut index: HashMap<PathBuf, usize> = HashMap::new();
        for (root, root_file) in roots.iter().enumerate() {
            // (file path, module path, is a mod-rs file whose children sit beside it)
            let mut stack = vec![(root_file.clone(), Vec::<String>::new(), true)];
            while let Some((path, module, mod_rs)) = stack.pop() {
                if index.contains_key(&path) {
                    continue;
                }
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                let facts = parse(&text);
                let id = graph.files.len();
                index.insert(path.clone(), id);
                let rel = path.strip_prefix(crate_dir).unwrap_or(&path);
                graph.files.push(rel.to_string_lossy().replace('\\', "/"));
                graph.file_module.push((root, module.clone()));
                graph.modules.insert(
                    (root, module.clone()),
                    Module {
                        file: id,
                        inline: Vec::new(),
                    },
                );
                let dir = match (mod_rs, path.parent()) {
                    (true, Some(parent)) => parent.to_path_buf(),
                    (false, Some(parent)) => parent.join(path.file_stem().unwrap_or_default()),
                    (_, None) => PathBuf::new(),
                };
                for (scope, name, inline) in &facts.mods {
                    let mut child = module.clone();
                    child.extend(scope.iter().cloned());
                    child.push(name.clone());
                    if *inline {
                        let mut inner = scope.clone();
                        inner.push(name.clone());
                        graph.modules.insert(
                            (root, child),
                            Module {
                                file: id,
                                inline: inner,
                            },
                        );
                        continue;
                    }
                    let mut base = dir.clone();
                    for part in scope {
                        base.push(part);
                    }
                    let flat = base.join(format!("{name}.rs"));
                    let nested = base.join(name).join("mod.rs");
                    if flat.is_file() {
                        stack.push((flat, child, false));
                    } else if nested.is_file() {
                        stack.push((nested, child, true));
                    }
                }
                graph.facts.push(facts);
            }
        }
        Ok(graph)
    }

    /// The module path `segments` names from `scope` (a module path), walking module by
    /// module; `None` for a path into another crate.
    fn resolve(&self, root: usize, scope: &[String], segments: &[String]) -> Option<Vec<String>> {
        self.resolve_at(root, scope, segments, 0)
    }

    fn resolve_at(
        &self,
        root: usize,
        scope: &[String],
        segments: &[String],
        depth: usize,
    ) -> Option<Vec<String>> {
        let first = segments.first()?;
        let (base, rest): (Vec<String>, &[String]) = match first.as_str() {
            "crate" => (Vec::new(), &segments[1..]),
            "self" => (scope.to_vec(), &segments[1..]),
            "super" => {
                let mut base = scope.to_vec();
                let mut k = 0;
                while segments.get(k).is_some_and(|s| s == "super") {
                    base.pop();
                    k += 1;
                }
                (base, &segments[k..])
            }
            "::" => return None,
            name => {
                let mut child = scope.to_vec();
                child.push(name.to_owned());
                if !self.modules.contains_key(&(root, child)) {
                    // A name a `use` of this scope binds (`use crate::flex;` then
                    // `flex::attention::forward`): the path it stands for.
                    let module = self.modules.get(&(root, scope.to_vec()))?;
                    let binding = self.facts[module.file].paths.iter().find(|p| {
                        p.is_use
                            && !p.glob
                            && p.scope == module.inline
                            && p.binds.as_deref() == Some(name)
                    })?;
                    if depth >= 8 {
                        return None;
                    }
                    let mut full = binding.segments.clone();
                    full.extend(segments[1..].iter().cloned());
                    return self.resolve_at(root, scope, &full, depth + 1);
                }
                (scope.to_vec(), segments)
            }
        };
        self.walk(root, base, rest, 0)
    }

    fn walk(
        &self,
        root: usize,
        mut module: Vec<String>,
        segments: &[String],
        depth: usize,
    ) -> Option<Vec<String>> {
        for (k, segment) in segments.iter().enumerate() {
            let mut child = module.clone();
            child.push(segment.clone());
            if self.modules.contains_key(&(root, child.clone())) {
                module = child;
                continue;
            }
            if module.is_empty() && depth < 8 {
                return self.through_root(root, segment, &segments[k + 1..], depth);
            }
            break;
        }
        Some(module)
    }

    /// Resolves a name of the crate root through the root's `use` declarations; a name the
    /// root does not import is the root's own.
    fn through_root(
        &self,
        root: usize,
        name: &str,
        rest: &[String],
        depth: usize,
    ) -> Option<Vec<String>> {
        let root_file = self.modules.get(&(root, Vec::new()))?.file;
        let facts = &self.facts[root_file];
        let root_uses = || {
            facts
                .paths
                .iter()
                .filter(|p| p.is_use && p.scope.is_empty())
        };
        if let Some(reexport) = root_uses().find(|p| p.binds.as_deref() == Some(name)) {
            let target = self.absolute(root, &reexport.segments)?;
            let mut full = target;
            full.extend(rest.iter().cloned());
            return self.walk(root, Vec::new(), &full, depth + 1);
        }
        for glob in root_uses().filter(|p| p.glob) {
            let Some(target) = self.absolute(root, &glob.segments) else {
                continue;
            };
            let Some(module) = self.walk(root, Vec::new(), &target, depth + 1) else {
                continue;
            };
            let Some(m) = self.modules.get(&(root, module.clone())) else {
                continue;
            };
            let defined = self.facts[m.file]
                .defines
                .get(&m.inline)
                .is_some_and(|names| names.contains(name));
            if !module.is_empty() && defined {
                return Some(module);
            }
        }
        Some(Vec::new())
    }

    /// `segments` of a root-scope `use` as a path from the crate root; `None` for another
    /// crate's path.
    fn absolute(&self, root: usize, segments: &[String]) -> Option<Vec<String>> {
        let first = segments.first()?;
        match first.as_str() {
            "crate" | "self" => Some(segments[1..].to_vec()),
            "::" | "super" => None,
            name => self
                .modules
                .contains_key(&(root, vec![name.to_owned()]))
                .then(|| segments.to_vec()),
        }
    }

    /// Edges between distinct files: from → to → first place (line: path).
    fn edges(&self) -> BTreeMap<usize, BTreeMap<usize, String>> {
        let mut edges: BTreeMap<usize, BTreeMap<usize, String>> = BTreeMap::new();
        for (file, facts) in self.facts.iter().enumerate() {
            let (root, module) = &self.file_module[file];
            for path in &facts.paths {
                let mut scope = module.clone();
                scope.extend(path.scope.iter().cloned());
                let Some(target) = self.resolve(*root, &scope, &path.segments) else {
                    continue;
                };
                let Some(to) = self.modules.get(&(*root, target)).map(|m| m.file) else {
                    continue;
                };
                if to != file {
                    let mut written = path.segments.join("::");
                    if path.glob {
                        written.push_str("::*");
                    }
                    edges
                        .entry(file)
                        .or_default()
                        .entry(to)
                        .or_insert_with(|| format!("{}: {written}", path.line));
                }
            }
        }
        edges
    }

    /// Strongly connected components with more than one file (Tarjan's algorithm).
    fn cycles(&self) -> Vec<Cycle> {
        let edges = self.edges();
        let n = self.files.len();
        let succ = |v: usize| -> Vec<usize> {
            edges
                .get(&v)
                .map(|m| m.keys().copied().collect())
                .unwrap_or_default()
        };
        let mut index = vec![usize::MAX; n];
        let mut low = vec![0; n];
        let mut on_stack = vec![false; n];
        let mut stack = Vec::new();
        let mut next = 0;
        let mut components = Vec::new();
        for start in 0..n {
            if index[start] != usize::MAX {
                continue;
            }
            // Iterative DFS: (vertex, its successors, next successor to visit).
            let mut work: Vec<(usize, Vec<usize>, usize)> = vec![(start, succ(start), 0)];
            index[start] = next;
            low[start] = next;
            next += 1;
            stack.push(start);
            on_stack[start] = true;
            while let Some((v, successors, at)) = work.last_mut() {
                let v = *v;
                if let Some(&w) = successors.get(*at) {
                    *at += 1;
                    if index[w] == usize::MAX {
                        index[w] = next;
                        low[w] = next;
                        next += 1;
                        stack.push(w);
                        on_stack[w] = true;
                        work.push((w, succ(w), 0));
                    } else if on_stack[w] {
                        low[v] = low[v].min(index[w]);
                    }
                    continue;
                }
                work.pop();
                if let Some((parent, _, _)) = work.last() {
                    low[*parent] = low[*parent].min(low[v]);
                }
                if low[v] == index[v] {
                    let mut component = Vec::new();
                    while let Some(w) = stack.pop() {
                        on_stack[w] = false;
                        component.push(w);
                        if w == v {
                            break;
                        }
                    }
                    if component.len() > 1 {
                        components.push(component);
                    }
                }
            }
        }
        let mut cycles: Vec<Cycle> = components
            .into_iter()
            .map(|component| {
                let members: BTreeSet<usize> = component.iter().copied().collect();
                let mut files: Vec<String> =
                    members.iter().map(|&f| self.files[f].clone()).collect();
                files.sort();
                let mut inner = Vec::new();
                for &from in &members {
                    for (to, at) in edges.get(&from).into_iter().flatten() {
                        if members.contains(to) {
                            inner.push((
                                self.files[from].clone(),
                                self.files[*to].clone(),
                                at.clone(),
                            ));
                        }
                    }
                }
                inner.sort();
                Cycle {
                    files,
                    edges: inner,
                }
            })
            .collect();
        cycles.sort_by(|a, b| a.files.cmp(&b.files));
        cycles
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic crate in a fresh temporary folder: (path under `src/`, contents).
    fn synthetic(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "xtask-cycles-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let path = dir.join("src").join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    fn cycle_files(dir: &Path) -> Vec<Vec<String>> {
        let cycles = crate_cycles(dir).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        cycles.into_iter().map(|c| c.files).collect()
    }

    #[test]
    fn a_cycle_through_a_third_file_is_found() {
        let dir = synthetic(
            "found",
            &[
                ("lib.rs", "mod a;\nmod b;\npub mod c;\nmod lone;\n"),
                ("a.rs", "use crate::b::helper;\npub fn a() { helper() }\n"),
                ("b.rs", "pub fn helper() { crate::c::deep::f() }\n"),
                ("c/mod.rs", "pub mod deep;\n"),
                (
                    "c/deep.rs",
                    "// crate::lone::x() in a comment is no edge\n\
                     pub fn f() { let _ = \"crate::lone::x\"; super::super::a::a(); }\n",
                ),
                ("lone.rs", "pub fn x() {}\n"),
            ],
        );
        assert_eq!(
            cycle_files(&dir),
            [["src/a.rs", "src/b.rs", "src/c/deep.rs"]]
        );
    }

    #[test]
    fn a_parent_declaring_its_child_is_no_edge() {
        // The child reaches its parent (`super::…`), the parent only declares the child and
        // its own tests use it: no cycle. A sibling module's item through `super::sibling`
        // is an edge to the sibling, not to the parent.
        let dir = synthetic(
            "parent",
            &[
                ("lib.rs", "pub mod flex;\n"),
                (
                    "flex/mod.rs",
                    "mod steps;\nmod util;\npub struct Shape;\n\
                     #[cfg(test)]\nmod tests { use super::*; }\n",
                ),
                (
                    "flex/steps.rs",
                    "use super::Shape;\nuse super::util::helper;\npub fn s(_: Shape) { helper() }\n",
                ),
                ("flex/util.rs", "pub fn helper() {}\n"),
            ],
        );
        let graph = Graph::build(&dir).unwrap();
        let edges = graph.edges();
        let named: Vec<(String, String)> = edges
            .iter()
            .flat_map(|(from, to)| {
                to.keys()
                    .map(|t| (graph.files[*from].clone(), graph.files[*t].clone()))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(
            named,
            [
                ("src/flex/steps.rs".to_owned(), "src/flex/mod.rs".to_owned()),
                (
                    "src/flex/steps.rs".to_owned(),
                    "src/flex/util.rs".to_owned()
                ),
            ]
        );
        assert!(cycle_files(&dir).is_empty());
    }

    #[test]
    fn a_child_using_its_parent_that_uses_it_is_a_cycle() {
        // impl blocks split over files: the child implements the parent's type, the parent
        // calls the child's helper.
        let dir = synthetic(
            "split",
            &[
                ("lib.rs", "mod model;\n"),
                (
                    "model.rs",
                    "mod forward;\npub struct M;\nfn g() { forward::step() }\n",
                ),
                (
                    "model/forward.rs",
                    "impl super::M { fn f(&self) {} }\npub fn step() {}\n",
                ),
            ],
        );
        assert_eq!(
            cycle_files(&dir),
            [["src/model.rs", "src/model/forward.rs"]]
        );
    }

    #[test]
    fn a_root_re_export_resolves_to_its_defining_module() {
        // `crate::Item`, `use crate::{Item}` and a glob re-export reach the defining file, not
        // lib.rs: a -> b through the re-export, b -> a directly.
        let dir = synthetic(
            "reexport",
            &[
                (
                    "lib.rs",
                    "mod a;\nmod b;\nmod c;\npub use b::{Item as Thing, Other};\npub use c::*;\n\
                     pub use std::fmt::Debug;\npub fn own() {}\n",
                ),
                (
                    "a.rs",
                    "use crate::{Thing};\npub fn a() -> Thing { Thing }\n",
                ),
                (
                    "b.rs",
                    "pub struct Item;\npub struct Other;\npub fn b() { crate::a::a(); }\n",
                ),
                (
                    "c.rs",
                    "pub fn from_c() {}\nfn x() { let _: &dyn crate::Debug; }\n",
                ),
                ("d.rs", ""),
            ],
        );
        let graph = Graph::build(&dir).unwrap();
        let to = |scope: &[&str], path: &str| {
            let scope: Vec<String> = scope.iter().map(|s| s.to_string()).collect();
            let segments: Vec<String> = path.split("::").map(str::to_owned).collect();
            graph
                .resolve(0, &scope, &segments)
                .and_then(|m| graph.modules.get(&(0, m)))
                .map(|m| graph.files[m.file].clone())
        };
        assert_eq!(to(&["a"], "crate::Thing").as_deref(), Some("src/b.rs"));
        assert_eq!(to(&["a"], "crate::Other").as_deref(), Some("src/b.rs"));
        assert_eq!(to(&["a"], "crate::from_c").as_deref(), Some("src/c.rs"));
        assert_eq!(to(&["c"], "crate::own").as_deref(), Some("src/lib.rs"));
        assert_eq!(to(&["c"], "crate::Debug"), None);
        assert_eq!(to(&["a"], "super::Thing").as_deref(), Some("src/b.rs"));
        assert_eq!(cycle_files(&dir), [["src/a.rs", "src/b.rs"]]);
    }

    #[test]
    fn a_module_name_bound_by_a_use_is_followed() {
        // `use crate::flex;` then `flex::attention::forward()`: an edge to flex/attention.rs,
        // which closes the cycle; an extern crate's name (`burn::…`) is no edge.
        let dir = synthetic(
            "bound",
            &[
                ("lib.rs", "mod flex;\nmod op;\n"),
                ("flex/mod.rs", "pub mod attention;\n"),
                (
                    "flex/attention.rs",
                    "pub fn forward() { crate::op::check() }\n",
                ),
                (
                    "op.rs",
                    "use crate::flex;\nuse burn::tensor as t;\npub fn check() {}\n\
                     fn run() { flex::attention::forward(); let _ = t::Tensor::new(); }\n",
                ),
            ],
        );
        assert_eq!(cycle_files(&dir), [["src/flex/attention.rs", "src/op.rs"]]);
    }

    #[test]
    fn inline_modules_scope_super_and_self() {
        let facts = parse(
            "mod outer {\n  mod inner {\n    use super::super::x::Y;\n    fn f() { self::g(); }\n  }\n}\n\
             use a::{self, b::{C as D, *}};\nfn h<'a>(c: char) { let _ = 'x'; let _ = r#\"crate::q\"#; }\n",
        );
        let paths: Vec<(Vec<String>, String)> = facts
            .paths
            .iter()
            .map(|p| (p.scope.clone(), p.segments.join("::")))
            .collect();
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            paths,
            [
                (s(&["outer", "inner"]), "super::super::x::Y".to_owned()),
                (s(&["outer", "inner"]), "self::g".to_owned()),
                (s(&[]), "a".to_owned()),
                (s(&[]), "a::b::C".to_owned()),
                (s(&[]), "a::b".to_owned()),
            ]
        );
        assert_eq!(facts.paths[3].binds.as_deref(), Some("D"));
        assert!(facts.paths[4].glob);
        assert_eq!(
            facts.mods,
            [
                (s(&[]), "outer".to_owned(), true),
                (s(&["outer"]), "inner".to_owned(), true)
            ]
        );
    }
}
