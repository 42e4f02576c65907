//! CPU time and peak RSS of a process, from `/proc` (Linux).

/// User + system CPU seconds of `pid`.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces: fields are counted after its ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime): (u64, u64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    // SAFETY: sysconf has no preconditions; it only reads a system constant.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some((utime + stime) as f64 / tck.max(1) as f64)
}

/// Peak resident set size (`VmHWM`) of `pid`, in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM")
}

/// A size field of `/proc/PID/status` (`VmRSS`, `VmSize`, `VmHWM`, …), in KiB.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Counts a process's system calls (all its threads) over a window, with
/// `perf stat -e raw_syscalls:sys_enter -p PID`: in-kernel counting, so unlike `strace` it barely
/// slows the process it watches.
pub struct SyscallCounter {
    child: std::process::Child,
}

impl SyscallCounter {
    /// Starts counting now.
    pub fn start(pid: u32) -> Result<Self, String> {
        let child = std::process::Command::new("perf")
            .args(["stat", "-x", ",", "-e", "raw_syscalls:sys_enter", "-p"])
            .arg(pid.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("--syscalls: cannot run perf: {e}"))?;
        // perf attaches asynchronously; give it a moment so the window is not cut short.
        std::thread::sleep(std::time::Duration::from_millis(100));
        Ok(SyscallCounter { child })
    }

    /// Stops counting and returns the number of system calls seen.
    pub fn finish(self) -> Result<u64, String> {
        // SAFETY: kill(2) on our own child's pid (perf prints its counts on SIGINT); at worst the
        // child already exited and the call fails.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let out = self
            .child
            .wait_with_output()
            .map_err(|e| format!("--syscalls: perf: {e}"))?;
        let text = String::from_utf8_lossy(&out.stderr);
        parse_perf_count(&text).ok_or_else(|| {
            format!(
                "--syscalls: no count from perf (is tracing allowed here?): {}",
                text.trim()
            )
        })
    }
}

/// The count from `perf stat -x ,` output (`<count>,,raw_syscalls:sys_enter,…`).
fn parse_perf_count(text: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.contains("raw_syscalls:sys_enter"))
        .and_then(|l| l.split(',').next())
        .and_then(|n| n.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_our_own_process() {
        let me = std::process::id();
        let mut x = 0u64;
        for i in 0..3_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert!(x > 0);
        assert!(super::cpu_seconds(me).is_some());
        assert!(super::peak_rss_kib(me).unwrap() > 0);
    }

    #[test]
    fn parses_perf_stat_csv() {
        let text = "12345,,raw_syscalls:sys_enter,1001234,100.00,,\n";
        assert_eq!(super::parse_perf_count(text), Some(12345));
        assert_eq!(
            super::parse_perf_count("<not counted>,,raw_syscalls:sys_enter"),
            None
        );
    }
}
