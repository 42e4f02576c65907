//! The module layering, checked: which top-level module may import which is the table in
//! `docs/architecture.md` ("Who may import whom"), and this test fails when the code imports
//! anything that table does not allow, when the table itself has a cycle, or when two files of one
//! module import each other (directly or around a loop). Test code (`#[cfg(test)] mod tests`) and
//! comments are not counted: a test may build whatever it needs, and a doc link is not a
//! dependency.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const BEGIN: &str = "<!-- layers -->";
const END: &str = "<!-- /layers -->";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `src/**/*.rs`, as paths relative to `src/`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src/").flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The file without comments and without its unit tests.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first path segment after every `prefix` (`crate::`, `super::`), with `prefix{a, b::c}`
/// groups split at their top level.
fn first_segments(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        // `super::` inside `crate::x::super::`? Never written; a preceding identifier char means
        // another path (`mycrate::`), so skip it.
        let before = rest[..i].chars().next_back();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut start = 0;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.insert(ident(&group[start..j]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(&group[start..j]));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.remove("");
    out
}

/// The allow-list from docs/architecture.md: `| module(s) | may import |` rows.
fn allowed() -> BTreeMap<String, BTreeSet<String>> {
    let page = std::fs::read_to_string(root().join("docs/architecture.md")).expect("docs/");
    let (a, b) = (
        page.find(BEGIN).expect("layers table start"),
        page.find(END).expect("layers table end"),
    );
    let names = |cell: &str| -> BTreeSet<String> {
        cell.split(',')
            .map(|s| s.trim().trim_matches('`').to_string())
            .filter(|s| !s.is_empty() && s != "—")
            .collect()
    };
    let mut out = BTreeMap::new();
    for line in page[a..b].lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').collect();
        assert_eq!(
            cells.len(),
            3,
            "layers row {line:?}: module | may import | why"
        );
        for m in names(cells[0]) {
            out.insert(m, names(cells[1]));
        }
    }
    out
}

/// The crate's top-level modules and, for each, what its non-test code imports of the others;
/// and for each module directory, its files' `super::` imports of their siblings.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn imports() -> (Graph, BTreeMap<String, Graph>) {
    let src = root().join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut top: Graph = BTreeMap::new();
    let mut within: BTreeMap<String, Graph> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let parts: Vec<String> = rel
            .iter()
            .map(|s| s.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        let module = parts[0].clone();
        if module == "lib" || module == "main" || module == "layers" {
            continue;
        }
        let text = code(&std::fs::read_to_string(&f).unwrap());
        let deps = top.entry(module.clone()).or_default();
        for d in first_segments(&text, "crate::") {
            if d != module {
                deps.insert(d);
            }
        }
        // Files of a module directory: `a.rs` importing `super::b` (its sibling `b.rs`).
        if parts.len() == 2 && parts[1] != "mod" {
            let dir = src.join(&module);
            let siblings = first_segments(&text, "super::")
                .into_iter()
                .filter(|s| s != &parts[1])
                .filter(|s| dir.join(format!("{s}.rs")).exists() || dir.join(s).is_dir())
                .collect();
            within
                .entry(module)
                .or_default()
                .insert(parts[1].clone(), siblings);
        }
    }
    (top, within)
}

/// A cycle in `g`, if any, as the path around it.
fn cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &Graph,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(1) => {
                let i = path.iter().position(|p| p == n).unwrap();
                let mut c = path[i..].to_vec();
                c.push(n.to_string());
                return Some(c);
            }
            Some(_) => return None,
            None => {}
        }
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, g, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    g.keys()
        .find_map(|n| visit(n, g, &mut state, &mut Vec::new()))
}

#[test]
fn every_import_is_one_the_layers_table_allows() {
    let allowed = allowed();
    let (top, _) = imports();
    let mut wrong = Vec::new();
    for (module, deps) in &top {
        let Some(ok) = allowed.get(module) else {
            wrong.push(format!(
                "{module}: no row in docs/architecture.md's layers table"
            ));
            continue;
        };
        for d in deps.iter().filter(|d| top.contains_key(*d)) {
            if !ok.contains(d) && !ok.contains("*") {
                wrong.push(format!("{module} imports {d}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports the layers table (docs/architecture.md) does not allow:\n  {}",
        wrong.join("\n  ")
    );
}

#[test]
fn the_layers_table_has_no_cycle() {
    let allowed: Graph = allowed()
        .into_iter()
        .map(|(m, d)| (m, d.into_iter().filter(|d| d != "*").collect()))
        .collect();
    assert_eq!(cycle(&allowed), None, "docs/architecture.md's layers table");
}

#[test]
fn no_two_files_of_a_module_import_each_other() {
    let (_, within) = imports();
    for (module, g) in within {
        assert_eq!(cycle(&g), None, "src/{module}/: files importing each other");
    }
}

#[test]
fn imports_are_read_through_groups_and_not_from_comments() {
    let c = code("use crate::{a::X, b::{Y, Z}, c};\n// crate::d\nfn f() { crate::e::g() }\n");
    let got: Vec<String> = first_segments(&c, "crate::").into_iter().collect();
    assert_eq!(got, ["a", "b", "c", "e"]);
    let g: Graph = [("a", "b"), ("b", "c"), ("c", "a")]
        .into_iter()
        .map(|(x, y)| (x.to_string(), [y.to_string()].into()))
        .collect();
    assert_eq!(cycle(&g).map(|c| c.len()), Some(4));
}
