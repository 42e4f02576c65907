//! The size rule of the code style, enforced so that it cannot come back: no `.rs`
//! file under `src/` or `shm/src/` over 900 lines, none under `tests/` over 1000, and no
//! function in `src/` or `shm/src/` over 100 lines (test code aside: `#[cfg(test)]` modules and
//! files named `tests.rs`). Small pieces read and review better; a file or function that grows
//! past the limit is split by concern rather than let grow.
//!
//! Functions are found the way a reader finds them: a line that starts with `fn` (after its
//! visibility and qualifiers), measured from that line to the line of its closing brace, the
//! braces counted in code only (not in strings, chars or comments).

use std::path::{Path, PathBuf};

const MAX_SOURCE_LINES: usize = 900;
const MAX_TEST_LINES: usize = 1000;
const MAX_FN_LINES: usize = 100;

#[test]
fn sources_tests_and_functions_stay_under_their_size_limits() {
    let root = crate::common::repo();
    assert!(
        root.join("src/lib.rs").is_file() && root.join("shm/src/lib.rs").is_file(),
        "{} is not the repository root",
        root.display()
    );
    let offenders = offenders(&root);
    assert!(
        offenders.is_empty(),
        "{} over the size limits (split them by concern):\n{}",
        offenders.len(),
        offenders.join("\n")
    );
}

/// Every file and function over its limit under `root`, one line each.
fn offenders(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["src", "shm/src"] {
        for path in rs_files(&root.join(dir)) {
            let text = std::fs::read_to_string(&path).expect("read a source file");
            let name = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .display()
                .to_string();
            let lines = text.lines().count();
            if lines > MAX_SOURCE_LINES {
                out.push(format!("{name}: {lines} lines (max {MAX_SOURCE_LINES})"));
            }
            if path.file_name().is_some_and(|f| f == "tests.rs") {
                continue;
            }
            for f in long_fns(&text) {
                out.push(format!(
                    "{name}:{}: fn {} is {} lines (max {MAX_FN_LINES})",
                    f.line, f.name, f.lines
                ));
            }
        }
    }
    for path in rs_files(&root.join("tests")) {
        let text = std::fs::read_to_string(&path).expect("read a test file");
        let lines = text.lines().count();
        if lines > MAX_TEST_LINES {
            let name = path.strip_prefix(root).unwrap_or(&path).display();
            out.push(format!("{name}: {lines} lines (max {MAX_TEST_LINES})"));
        }
    }
    out
}

/// Every `.rs` file under `dir`, in a stable order.
pub(crate) fn rs_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A function over the limit: its name, first line (1-based) and length in lines.
#[derive(Debug, PartialEq)]
struct LongFn {
    name: String,
    line: usize,
    lines: usize,
}

/// The functions of `text` longer than [`MAX_FN_LINES`], outside `#[cfg(test)]` modules.
fn long_fns(text: &str) -> Vec<LongFn> {
    let code = code_only(text);
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        if line == "#[cfg(test)]" {
            // Skip the item it gates when that is a module with a body (attributes between).
            let mut j = i + 1;
            while j < lines.len() && lines[j].trim().starts_with("#[") {
                j += 1;
            }
            if j < lines.len() && is_mod_with_body(lines[j]) {
                i = block_end(&lines, j).map_or(lines.len(), |e| e + 1);
                continue;
            }
        }
        if let Some(name) = fn_name(line) {
            if let Some(end) = block_end(&lines, i) {
                let n = end - i + 1;
                if n > MAX_FN_LINES {
                    out.push(LongFn {
                        name: name.to_string(),
                        line: i + 1,
                        lines: n,
                    });
                }
            }
        }
        i += 1;
    }
    out
}

/// `mod name {` (with any visibility).
fn is_mod_with_body(line: &str) -> bool {
    let rest = strip_visibility(line.trim());
    rest.strip_prefix("mod ")
        .is_some_and(|r| !r.trim_end().ends_with(';'))
}

/// The line holding the brace that closes the first block opened at or after `start`; `None`
/// for a declaration without a body (a line that ends with `;` before any brace).
fn block_end(lines: &[&str], start: usize) -> Option<usize> {
    let mut depth = 0i64;
    let mut started = false;
    for (j, line) in lines.iter().enumerate().skip(start) {
        for c in line.chars() {
            match c {
                '{' => {
                    depth += 1;
                    started = true;
                }
                '}' => depth -= 1,
                _ => {}
            }
            if started && depth == 0 {
                return Some(j);
            }
        }
        if !started && line.trim_end().ends_with(';') {
            return None;
        }
    }
    None
}

/// `pub`, `pub(crate)`, `pub(in path)` … removed from the start of `s`.
fn strip_visibility(s: &str) -> &str {
    let Some(rest) = s.strip_prefix("pub") else {
        return s;
    };
    let rest = match rest.strip_prefix('(') {
        Some(r) => r.split_once(')').map_or(r, |(_, after)| after),
        None if rest.starts_with(char::is_whitespace) => rest,
        None => return s,
    };
    rest.trim_start()
}

/// The function's name if `line` (trimmed, literals blanked) starts a function: `fn name`
/// after a visibility and the qualifiers `const`, `async`, `unsafe`, `default`, `extern "ABI"`.
fn fn_name(line: &str) -> Option<&str> {
    let mut rest = strip_visibility(line);
    loop {
        let mut advanced = false;
        for q in ["const ", "async ", "unsafe ", "default ", "extern "] {
            if let Some(r) = rest.strip_prefix(q) {
                rest = r.trim_start();
                advanced = true;
            }
        }
        // The ABI string of `extern "C"` (blanked to `"…"`).
        if rest.starts_with('"') {
            rest = rest[1..].split_once('"').map(|(_, r)| r.trim_start())?;
            advanced = true;
        }
        if !advanced {
            break;
        }
    }
    let rest = rest.strip_prefix("fn ")?.trim_start();
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    (end > 0).then(|| &rest[..end])
}

/// `src` with the contents of comments, string literals and char literals replaced by spaces
/// (line breaks kept, so line numbers hold), and the quotes of strings kept: only code braces
/// are left to count.
fn code_only(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < c.len() {
        let at = |k: usize| c.get(k).copied().unwrap_or('\0');
        if c[i] == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c[i] == '/' && at(i + 1) == '*' {
            // Block comments nest in Rust.
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(c[i]));
                    i += 1;
                }
            }
        } else if let Some(hashes) = raw_string_start(&c, i) {
            // r"…", r#"…"#, br"…": no escapes; ends at `"` followed by as many `#`.
            let open = c[i..].iter().position(|&x| x == '"').unwrap_or(0) + i;
            out.extend(std::iter::repeat_n(' ', open - i));
            out.push('"');
            i = open + 1;
            while i < c.len() {
                if c[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#') {
                    out.push('"');
                    out.extend(std::iter::repeat_n(' ', hashes));
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(c[i]));
                i += 1;
            }
        } else if c[i] == '"' {
            out.push('"');
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < c.len() {
                    out.push(blank(c[i]));
                    i += 1;
                }
            }
            out.push('"');
            i += 1;
        } else if c[i] == '\'' && (at(i + 1) == '\\' || at(i + 2) == '\'') {
            // A char literal ('x', '\n', '\'', '\u{…}'); otherwise `'` starts a lifetime.
            out.push('\'');
            i += 1;
            if c[i] == '\\' {
                // The escape and the char it escapes (which may be a quote).
                out.push_str("  ");
                i += 2;
            }
            while i < c.len() && c[i] != '\'' {
                out.push(' ');
                i += 1;
            }
            out.push('\'');
            i += 1;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// The number of `#` of a raw string (byte string) literal starting at `i`, if one does.
fn raw_string_start(c: &[char], i: usize) -> Option<usize> {
    // Not the tail of an identifier (`for"`, `attr"`).
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return None;
    }
    let mut k = i;
    if c.get(k) == Some(&'b') || c.get(k) == Some(&'c') {
        k += 1;
    }
    if c.get(k) != Some(&'r') {
        return None;
    }
    k += 1;
    let mut hashes = 0;
    while c.get(k) == Some(&'#') {
        hashes += 1;
        k += 1;
    }
    (c.get(k) == Some(&'"')).then_some(hashes)
}

#[test]
fn the_scan_ignores_braces_in_literals_and_comments_and_skips_test_modules() {
    let body = "    let x = 1;\n".repeat(MAX_FN_LINES);
    let src = format!(
        "pub(crate) async fn long() {{\n    let s = \"}}}}\"; let c = '}}'; // }}\n    /* }} /* }} */ */ let r = r#\"}}\"#;\n{body}}}\n\
         fn short<'a>(x: &'a str) -> [u8; 2] {{\n    [0; 2]\n}}\n\
         #[cfg(test)]\nmod tests {{\n    fn long_test() {{\n{body}    }}\n}}\n"
    );
    assert_eq!(
        long_fns(&src),
        [LongFn {
            name: "long".into(),
            line: 1,
            lines: MAX_FN_LINES + 4,
        }]
    );
    assert_eq!(fn_name("unsafe extern \"C\" fn kv_open("), Some("kv_open"));
    assert_eq!(fn_name("pub fn_like = 1;"), None);
    assert_eq!(fn_name("fn f();"), Some("f"));
    assert_eq!(code_only("'\\'' { '\\\\' }"), "'  ' { '  ' }");
    assert_eq!(block_end(&["fn f();"], 0), None);
}
