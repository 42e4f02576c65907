//! CPU time and memory of a process, from `/proc` (Linux): the `process_*` metrics, and the
//! bench's figures for the processes it measures.

/// User + system CPU seconds of `pid`.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces: fields are counted after its ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime): (u64, u64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    let tck = rustix::param::clock_ticks_per_second();
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
}
