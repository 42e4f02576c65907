//! The real SMG gateway for the tests: PyPI `smg` 1.13.0 (pinned in `scripts/smg-venv.sh`),
//! started as a child process with a routing policy over a list of gRPC worker URLs, and the bits of
//! HTTP the tests speak to it (its OpenAI endpoint and its Prometheus page).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, retry_on_taken_port};

/// How long one HTTP exchange with the gateway may take.
const T: Duration = Duration::from_secs(60);

/// `scripts/smg-venv.sh` (idempotent); the `smg` command beside the python it prints. Fails,
/// never skips, when the wheel cannot be installed.
pub fn smg_command() -> PathBuf {
    let py = super::setup_script(
        "smg-venv.sh",
        &[],
        "Python >= 3.10 with pip and PyPI access",
    );
    let smg = py.with_file_name("smg");
    assert!(smg.exists(), "no smg command beside {}", py.display());
    smg
}

/// A child process killed (by its own id) when dropped, with the file its output goes to.
pub struct Proc(pub Child, pub PathBuf);

impl Proc {
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.1).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` with stdout and stderr in `dir/NAME.log` (made anew).
pub fn spawn(name: &str, dir: &Path, cmd: &mut Command) -> Proc {
    let log = dir.join(format!("{name}.log"));
    let f = std::fs::File::create(&log).unwrap();
    let child = cmd
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    Proc(child, log)
}

/// POST `body` (JSON) to `addr`; (status, the whole response, head included).
pub fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// A Prometheus page (the gateway's or kvbridge's; empty while nothing listens yet).
pub fn get_metrics(port: u16) -> String {
    let Ok(mut c) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    c.set_read_timeout(Some(T)).unwrap();
    let _ = write!(
        c,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    );
    let mut page = String::new();
    let _ = c.read_to_string(&mut page);
    page
}

/// A running gateway: its process, its HTTP address and its Prometheus port.
pub struct Smg {
    pub proc: Proc,
    pub http: SocketAddr,
    pub prom: u16,
}

impl Smg {
    /// `smg launch --worker-urls URLS… --policy POLICY --block-size BLOCK EXTRA…` on two
    /// ports picked beforehand (the gateway has a port for HTTP and one for Prometheus and
    /// reports neither, so port 0 would leave the two indistinguishable), started again on
    /// fresh ports when one was taken in between. Its output goes to `dir/NAME.log`. Returns
    /// once it listens on both.
    pub fn launch(
        name: &str,
        dir: &Path,
        urls: &[String],
        policy: &str,
        block_size: usize,
        extra: &[&str],
    ) -> Smg {
        let smg = smg_command();
        let args: Vec<&str> = ["--policy", policy].iter().chain(extra).copied().collect();
        retry_on_taken_port(|| Smg::try_launch(name, dir, &smg, urls, block_size, &args))
    }

    fn try_launch(
        name: &str,
        dir: &Path,
        smg: &Path,
        urls: &[String],
        block_size: usize,
        extra: &[&str],
    ) -> Result<Smg, String> {
        let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let prom = free_port();
        let mut cmd = Command::new(smg.with_file_name("python"));
        // The venv's python runs the `smg` script (its shebang names the path the venv was
        // created at, which a copied target directory no longer has).
        cmd.arg(smg).args(["launch", "--worker-urls"]).args(urls);
        cmd.args([
            "--host",
            "127.0.0.1",
            "--port",
            &http.port().to_string(),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            &prom.to_string(),
            "--block-size",
            &block_size.to_string(),
        ])
        .args(extra);
        let mut proc = spawn(name, dir, &mut cmd);
        let pid = proc.0.id();
        super::eventually("the gateway listens on both ports", T, || {
            if let Ok(Some(st)) = proc.0.try_wait() {
                return Ok(Err(format!("the gateway exited ({st}):\n{}", proc.log())));
            }
            let ports = super::listening_ports(pid);
            if ports.contains(&http.port()) && ports.contains(&prom) {
                Ok(Ok(()))
            } else {
                Err(ports)
            }
        })?;
        Ok(Smg { proc, http, prom })
    }

    /// The gateway's Prometheus page.
    pub fn metrics(&self) -> String {
        get_metrics(self.prom)
    }
}
