//! `examples/read_ring.c` compiled with the system C compiler against `include/kvbridge_shm.h`
//! and `libkvbridge_shm_c.so`, run against a ring this test writes: it reads N records (from the
//! oldest and from the middle) whose sequence numbers, metadata, lengths and payload hashes
//! equal what was written, then sees the closed writer as `KVB_WRITER_GONE` with the position to
//! resume from. The header also compiles as C++ (`-fsyntax-only`).

use std::path::{Path, PathBuf};
use std::process::Command;

use kvbridge_shm::{RecordMeta, RingWriter, WriterOptions};

fn fnv1a64(p: &[u8]) -> u64 {
    p.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn payload(i: u64) -> Vec<u8> {
    (0..(i * 37 % 500 + 1)).map(|j| (i * 7 + j) as u8).collect()
}

fn meta(i: u64) -> RecordMeta {
    RecordMeta {
        dp_rank: (i % 4) as u32,
        upstream_seq: 1000 + i,
        flags: (i % 3) as u32,
        ingest_ns: 1_700_000_000_000_000_000 + i,
        upstream_digest: 0,
    }
}

/// The directory holding this package's `libkvbridge_shm_c.so`: cargo builds the library's
/// crate types for the integration tests and places them in `<target>/<profile>/` (and `deps/`).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for d in [deps.parent().unwrap(), deps] {
        if d.join("libkvbridge_shm_c.so").is_file() {
            return d.to_path_buf();
        }
    }
    panic!("libkvbridge_shm_c.so not found beside {}", exe.display());
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

fn compile(out: &Path) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir();
    let st = Command::new(cc())
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2"])
        .arg("-I")
        .arg(dir.join("include"))
        .arg(dir.join("examples/read_ring.c"))
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lkvbridge_shm_c")
        .status()
        .expect("run the C compiler (set CC)");
    assert!(st.success(), "compiling examples/read_ring.c failed");
}

#[test]
fn c_example_reads_n_records_and_sees_the_writer_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let ring = tmp.path().join("ring");
    let n = 50u64;
    {
        let mut w = RingWriter::open(
            &ring,
            &WriterOptions {
                capacity: 1 << 20,
                seq_base: Some(1),
                ..Default::default()
            },
        )
        .unwrap();
        for i in 1..=n {
            let p = payload(i);
            let mut res = w.reserve(p.len()).unwrap();
            res.buf().copy_from_slice(&p);
            res.commit(meta(i));
        }
    } // clean close: readers see the writer gone at once
    let exe = tmp.path().join("read_ring");
    compile(&exe);
    for (start, count) in [(1u64, n), (21, n - 20)] {
        let out = Command::new(&exe)
            .arg(&ring)
            .arg(start.to_string())
            .arg(count.to_string())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "read_ring failed: {}\n{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut want = vec![format!("window 1 {n}")];
        for i in start..=n {
            let (p, m) = (payload(i), meta(i));
            want.push(format!(
                "record {i} {} {} {} {} {:016x}",
                m.upstream_seq,
                m.dp_rank,
                m.flags,
                p.len(),
                fnv1a64(&p)
            ));
        }
        // KVB_WRITER_GONE (4), positioned at N + 1.
        want.push(format!("next 4 {}", n + 1));
        assert_eq!(stdout.lines().collect::<Vec<_>>(), want);
    }
    // Errors are codes, not crashes.
    let out = Command::new(&exe)
        .arg(tmp.path().join("missing"))
        .args(["1", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ring file does not exist"));
    let out = Command::new(&exe)
        .arg(&ring)
        .args([&(n + 2).to_string(), "1"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("beyond newest + 1"));
}

#[test]
fn header_compiles_as_cpp() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("use.cpp");
    std::fs::write(
        &src,
        "#include \"kvbridge_shm.h\"\nint main() { kvb_reader *r = nullptr; \
         return kvb_open(\"/nonexistent\", &r) == KVB_ERR_NOT_FOUND ? 0 : 1; }\n",
    )
    .unwrap();
    let st = Command::new(cxx)
        .args(["-std=c++17", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(dir.join("include"))
        .arg(&src)
        .status()
        .expect("run the C++ compiler (set CXX)");
    assert!(st.success(), "kvbridge_shm.h does not compile as C++");
}
