//! The engine's msgpack read by vLLM's own classes ([`VllmDecoder`]), every field a test needs
//! kept ([`VllmEvent`]).

use super::*;

/// The real vLLM's own decoder (`vllm.distributed.kv_events`, tests/real_engine/vllm_ops.py),
/// a long-lived process: one JSON line out per payload in.
pub struct VllmDecoder {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The script's first line, `{"ready": true, …}`.
    pub ready: serde_json::Value,
}

impl VllmDecoder {
    pub fn start() -> VllmDecoder {
        Self::run("vllm_ops.py", &[])
    }

    /// `tests/real_engine/SCRIPT ARGS` with the venv's python, once it has printed its ready
    /// line: vllm_ops.py, or a script that answers its protocol after work of its own
    /// (publish_shapes.py publishes first, and says what in its ready line).
    pub fn run(script: &str, args: &[String]) -> VllmDecoder {
        let mut child = Command::new(python())
            .arg(repo().join("tests/real_engine").join(script))
            .args(args)
            .env("OMP_NUM_THREADS", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {script}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let ready: serde_json::Value =
            serde_json::from_str(&line).unwrap_or(serde_json::Value::Null);
        assert!(
            ready["ready"] == true,
            "{script} did not start (it imports vllm.distributed.kv_events): {line:?}"
        );
        VllmDecoder {
            child,
            stdin,
            stdout,
            ready,
        }
    }

    /// One decoder for the whole test process, started by the first call: importing vLLM costs
    /// ~15 s of CPU, which tests running at once had better not pay each. A test that calls this
    /// early, on a thread of its own, has it imported by the time it needs it. It ends with the
    /// test process (its stdin closes).
    pub fn shared() -> std::sync::MutexGuard<'static, VllmDecoder> {
        static SHARED: OnceLock<Mutex<VllmDecoder>> = OnceLock::new();
        // A test that failed while holding it left it between two payloads: still usable.
        SHARED
            .get_or_init(|| Mutex::new(VllmDecoder::start()))
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// vLLM's reading of each payload, as ops.
    pub fn ops(&mut self, batches: &[Batch]) -> Vec<Op> {
        self.events(batches).iter().map(|(_, e)| e.op()).collect()
    }

    /// vLLM's reading of each payload, as vllm_ops.py prints it: per batch, its seq and its
    /// events (every field the script emits).
    fn answers(&mut self, batches: &[Batch]) -> Vec<(u64, Vec<serde_json::Value>)> {
        let mut out = Vec::new();
        for (seq, p) in batches {
            let hex: String = p.iter().map(|b| format!("{b:02x}")).collect();
            writeln!(self.stdin, "{}", serde_json::json!({ "payload": hex })).unwrap();
            let mut line = String::new();
            self.stdout.read_line(&mut line).unwrap();
            let v: serde_json::Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("vllm_ops.py answered {line:?}: {e}"));
            assert!(
                v.get("error").is_none(),
                "vLLM's own decoder rejects batch {seq}: {v}"
            );
            out.push((*seq, v["events"].as_array().unwrap().clone()));
        }
        out
    }

    /// vLLM's reading of each payload: its events in order, each as vllm_ops.py prints it.
    pub fn json_events(&mut self, batches: &[Batch]) -> Vec<serde_json::Value> {
        self.answers(batches)
            .into_iter()
            .flat_map(|(_, evs)| evs)
            .collect()
    }

    /// vLLM's reading of each payload: every event, with the seq of its batch.
    pub fn events(&mut self, batches: &[Batch]) -> Vec<(u64, VllmEvent)> {
        let mut out = Vec::new();
        for (seq, events) in self.answers(batches) {
            let u64s = |v: &serde_json::Value| -> Vec<u64> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect()
            };
            let text = |v: &serde_json::Value| v.as_str().map(str::to_string);
            let group = |v: &serde_json::Value| v.as_u64().map(|g| g as u32);
            for e in &events {
                let ev = match e["type"].as_str().unwrap() {
                    "BlockStored" => VllmEvent::Stored {
                        group: group(&e["group_idx"]),
                        kind: text(&e["kv_cache_spec_kind"]),
                        medium: text(&e["medium"]),
                        hashes: u64s(&e["block_hashes"]),
                        parent: e["parent_block_hash"].as_u64(),
                        tokens: u64s(&e["token_ids"])
                            .into_iter()
                            .map(|t| t as u32)
                            .collect(),
                        block_size: e["block_size"].as_u64().unwrap(),
                    },
                    "BlockRemoved" => VllmEvent::Removed {
                        group: group(&e["group_idx"]),
                        medium: text(&e["medium"]),
                        hashes: u64s(&e["block_hashes"]),
                    },
                    "AllBlocksCleared" => VllmEvent::Cleared,
                    other => panic!("vLLM decoded an unexpected event {other}"),
                };
                out.push((seq, ev));
            }
        }
        out
    }
}

/// One event as vLLM's own classes read it (`tests/real_engine/vllm_ops.py`), with the fields
/// that say what a block is: its KV-cache group and the group's kind, its medium (tier).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VllmEvent {
    Stored {
        group: Option<u32>,
        /// `kv_cache_spec_kind`.
        kind: Option<String>,
        medium: Option<String>,
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u64,
    },
    Removed {
        group: Option<u32>,
        medium: Option<String>,
        hashes: Vec<u64>,
    },
    Cleared,
}

impl VllmEvent {
    /// The op it is, every field carried as vLLM decoded it.
    pub fn op(&self) -> Op {
        match self {
            VllmEvent::Stored {
                group,
                hashes,
                parent,
                tokens,
                ..
            } => Op::Store {
                group: *group,
                hashes: hashes.clone(),
                parent: *parent,
                tokens: tokens.clone(),
            },
            VllmEvent::Removed { group, hashes, .. } => Op::Remove {
                group: *group,
                hashes: hashes.clone(),
            },
            VllmEvent::Cleared => Op::Clear,
        }
    }
}

impl Drop for VllmDecoder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
