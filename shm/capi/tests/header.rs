//! `include/kvbridge_shm.h` is exactly what cbindgen generates from `src/lib.rs` (with
//! `cbindgen.toml`): the committed header can never drift from the ABI. To regenerate after
//! changing the ABI: `KVBRIDGE_BLESS=1 cargo test --release -p kvbridge-shm-capi --test header`.

use std::path::PathBuf;

#[test]
fn committed_header_is_what_cbindgen_generates() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("kvbridge_shm.h");
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen")
        .write_to_file(&out);
    let generated = std::fs::read(&out).unwrap();
    assert!(!generated.is_empty(), "cbindgen generated nothing");
    let path = dir.join("include/kvbridge_shm.h");
    if std::env::var_os("KVBRIDGE_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} differs from cbindgen's output; regenerate with KVBRIDGE_BLESS=1 cargo test \
         --release -p kvbridge-shm-capi --test header\n--- generated\n{}",
        path.display(),
        String::from_utf8_lossy(&generated)
    );
}
