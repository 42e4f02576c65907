//! The ordering rule of the code style, enforced so that it cannot come back: every atomic
//! access in `src/` stronger than `Relaxed` (`Acquire`, `Release`, `AcqRel`,
//! `SeqCst`, also in fences) names the access it pairs with, in a comment on its line or the
//! four lines above ("pairs with …"), as crossbeam and Aeron do. An ordering that pairs with
//! nothing is `Relaxed`, and says why where the atomic is declared. Test code aside (`tests.rs`
//! files, and what follows `#[cfg(test)]` in a file). `shm/src/` documents its protocol in
//! `shm/LAYOUT.md` and names most pairs in place; it is not held to this check yet.

const STRONG: [&str; 4] = [
    "Ordering::Acquire",
    "Ordering::Release",
    "Ordering::AcqRel",
    "Ordering::SeqCst",
];

#[test]
fn every_acquire_and_release_names_its_pair() {
    let root = crate::common::repo();
    let mut unnamed = Vec::new();
    let mut named = 0;
    for dir in ["src"] {
        for path in crate::source_sizes::rs_files(&root.join(dir)) {
            if path.file_name().is_some_and(|n| n == "tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read a source file");
            let (n, bad) = check(&text);
            named += n;
            let rel = path.strip_prefix(&root).unwrap_or(&path).to_path_buf();
            unnamed.extend(bad.into_iter().map(|l| format!("{}:{l}", rel.display())));
        }
    }
    assert!(
        unnamed.is_empty(),
        "orderings that name no pair (add \"pairs with …\" in a comment, or make them Relaxed):\n{}",
        unnamed.join("\n")
    );
    assert!(
        named > 0,
        "no ordering found at all: is {} the repository?",
        root.display()
    );
}

/// (orderings that name their pair, 1-based lines of those that do not) in `text`, up to its
/// first `#[cfg(test)]`.
fn check(text: &str) -> (usize, Vec<usize>) {
    let lines: Vec<&str> = text
        .lines()
        .take_while(|l| l.trim() != "#[cfg(test)]")
        .collect();
    let (mut named, mut bad) = (0, Vec::new());
    for (i, line) in lines.iter().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        if !STRONG.iter().any(|s| code.contains(s)) {
            continue;
        }
        let context = &lines[i.saturating_sub(4)..=i];
        if context
            .iter()
            .any(|l| l.to_ascii_lowercase().contains("pairs with"))
        {
            named += 1;
        } else {
            bad.push(i + 1);
        }
    }
    (named, bad)
}

#[test]
fn the_check_sees_an_unnamed_ordering() {
    let (n, bad) = check("fn f(a: &AtomicU64) {\n    a.store(1, Ordering::Release);\n}\n");
    assert_eq!((n, bad), (0, vec![2]));
    let (n, bad) =
        check("// Release: pairs with the Acquire in `g`.\na.store(1, Ordering::Release);\n");
    assert_eq!((n, bad), (1, vec![]));
}
