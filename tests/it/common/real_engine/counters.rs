//! vLLM's own Prometheus counters of an engine in gRPC mode ([`VllmCounters`]).

use super::*;

/// vLLM's own Prometheus counters, read from an engine's `PROMETHEUS_MULTIPROC_DIR`
/// ([`RealEngine::prometheus_dir`]) by the engine's `prometheus_client`
/// (tests/real_engine/vllm_counters.py), a long-lived process: one directory in, one JSON line
/// out, each sample name with its value summed over its labels.
pub struct VllmCounters {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl VllmCounters {
    pub fn start() -> VllmCounters {
        let mut child = Command::new(python())
            .arg(repo().join("tests/real_engine/vllm_counters.py"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start vllm_counters.py");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(
            line.contains("ready"),
            "vllm_counters.py did not start (it imports prometheus_client): {line:?}"
        );
        VllmCounters {
            child,
            stdin,
            stdout,
        }
    }

    /// The engine's counters now: sample name (`vllm:prefix_cache_hits_total`, …) → value,
    /// summed over its labels.
    pub fn read(&mut self, engine: &RealEngine) -> std::collections::HashMap<String, f64> {
        writeln!(self.stdin, "{}", engine.prometheus_dir().display()).unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("vllm_counters.py answered {line:?}: {e}"))
    }
}

impl Drop for VllmCounters {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
