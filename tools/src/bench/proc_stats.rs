//! What the bench measures of a process: CPU time and memory (from `/proc`, shared with the
//! `process_*` metrics in [`kvbridge::metrics::process`]) and system calls (`perf`).

pub use kvbridge::metrics::process::{cpu_seconds, peak_rss_kib, status_kib};

/// The calling thread's CPU time (s), exact to the call (`CLOCK_THREAD_CPUTIME_ID`; the
/// scheduler's statistics in `/proc` lag by up to a tick for a thread that is running).
pub fn thread_cpu_seconds() -> f64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// The calling process's CPU time (s), all its threads, exact to the call
/// (`CLOCK_PROCESS_CPUTIME_ID`).
pub fn process_cpu_seconds() -> f64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Counts a process's system calls (all its threads) over a window, with
/// `perf stat -e raw_syscalls:sys_enter -p PID`: in-kernel counting, so unlike `strace` it barely
/// slows the process it watches. Its socket writes are counted apart: `sendto` of more than one
/// byte (the one-byte ones are ZMQ's and tokio's internal wake-ups), which in the bench are the
/// gRPC edge's writes.
pub struct SyscallCounter {
    child: std::process::Child,
}

impl SyscallCounter {
    /// Starts counting now.
    pub fn start(pid: u32) -> Result<Self, String> {
        let child = std::process::Command::new("perf")
            .args(["stat", "-x", ",", "-e", "raw_syscalls:sys_enter"])
            .args(["-e", SENDS, "--filter", "len > 1", "-p"])
            .arg(pid.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("--syscalls: cannot run perf: {e}"))?;
        // perf attaches asynchronously; give it a moment so the window is not cut short.
        std::thread::sleep(std::time::Duration::from_millis(100));
        Ok(SyscallCounter { child })
    }

    /// Stops counting: the system calls seen, and of them the socket writes.
    pub fn finish(self) -> Result<SyscallCounts, String> {
        // perf prints its counts on SIGINT; at worst the child already exited and the call fails.
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::INT,
        );
        let out = self
            .child
            .wait_with_output()
            .map_err(|e| format!("--syscalls: perf: {e}"))?;
        let text = String::from_utf8_lossy(&out.stderr);
        let count = |event| {
            parse_perf_count(&text, event).ok_or_else(|| {
                format!(
                    "--syscalls: no {event} count from perf (is tracing allowed here?): {}",
                    text.trim()
                )
            })
        };
        Ok(SyscallCounts {
            all: count(ALL)?,
            sends: count(SENDS)?,
        })
    }
}

/// Every system call.
const ALL: &str = "raw_syscalls:sys_enter";
/// Socket writes (counted with a filter: more than one byte).
const SENDS: &str = "syscalls:sys_enter_sendto";

/// What [`SyscallCounter`] counted.
#[derive(Clone, Copy, Debug)]
pub struct SyscallCounts {
    /// Every system call.
    pub all: u64,
    /// `sendto` of more than one byte: the gRPC edge's socket writes.
    pub sends: u64,
}

/// The count of `event` from `perf stat -x ,` output (`<count>,,<event>,…`).
fn parse_perf_count(text: &str, event: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.split(',').nth(2) == Some(event))
        .and_then(|l| l.split(',').next())
        .and_then(|n| n.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_perf_stat_csv() {
        let text = "12345,,raw_syscalls:sys_enter,1001234,100.00,,\n\
                    678,,syscalls:sys_enter_sendto,1001234,100.00,,\n";
        assert_eq!(super::parse_perf_count(text, super::ALL), Some(12345));
        assert_eq!(super::parse_perf_count(text, super::SENDS), Some(678));
        assert_eq!(
            super::parse_perf_count("<not counted>,,raw_syscalls:sys_enter", super::ALL),
            None
        );
    }
}
