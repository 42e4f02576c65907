//! `--kv-events-config`: the JSON the engine itself was given, turned into kvbridge's ranks the
//! way the engine turns it into publishers (docs/engine-wire.md §2).
//!
//! For each DP rank `r` of `--data-parallel-size N` the engine offsets the port of the configured
//! PUB and replay endpoints by `r` (§2.2), binds its PUB when the endpoint names a wildcard and
//! connects it otherwise (§2.1), and always binds the replay ROUTER. kvbridge does the opposite
//! of the PUB (connect to a bound one, with the wildcard rewritten to loopback; bind where the
//! engine connects) and always connects to the replay ROUTER.
//!
//! Where the engine families' rules differ for a configuration (`0.0.0.0`, SGLang's `bind` key),
//! the family must be named with `--engine`; everything else is the same in all of them.

use std::fmt;

use serde_json::{Map, Value};

use super::values::validate_endpoint;
use crate::ingest::RankEndpoint;

/// The engine family that was given the configuration (only needed where their rules differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum EngineFamily {
    /// vLLM: events need `"enable_kv_cache_events": true`; `0.0.0.0` means "connect".
    Vllm,
    /// SGLang: events need `"publisher": "zmq"`; `0.0.0.0` is bound (≥ 0.5.13); an explicit
    /// `"bind"` wins over the endpoint string (≥ 0.5.22).
    Sglang,
    /// TokenSpeed: events need `"enable_kv_cache_events": true`.
    Tokenspeed,
}

impl EngineFamily {
    const ALL: [EngineFamily; 3] = [
        EngineFamily::Vllm,
        EngineFamily::Sglang,
        EngineFamily::Tokenspeed,
    ];
}

impl fmt::Display for EngineFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineFamily::Vllm => "vLLM",
            EngineFamily::Sglang => "SGLang",
            EngineFamily::Tokenspeed => "TokenSpeed",
        })
    }
}

/// Every key of the engines' `KVEventsConfig` (vLLM, SGLang, TokenSpeed); any other key is
/// reported as ignored.
const KNOWN_KEYS: [&str; 10] = [
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "snapshot_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
    "bind",
];

/// The engines' defaults (docs/engine-wire.md §2.1, identical in all three).
const DEFAULT_ENDPOINT: &str = "tcp://*:5557";

/// The settings of the engine's configuration that decide where its events are.
#[derive(Debug)]
struct EngineKvConfig {
    enable_kv_cache_events: bool,
    publisher: Option<String>,
    endpoint: String,
    replay_endpoint: Option<String>,
    /// vLLM #57789 (unmerged): the snapshot ROUTER, port + rank like the others.
    snapshot_endpoint: Option<String>,
    topic: String,
    bind: Option<bool>,
    ignored: Vec<String>,
}

/// What the engine's configuration means for kvbridge.
#[derive(Debug)]
pub(super) struct Derived {
    /// One per DP rank, in rank order.
    pub(super) ranks: Vec<RankEndpoint>,
    /// The engine's topic.
    pub(super) topic: String,
    /// Keys kvbridge ignored (logged at start-up).
    pub(super) ignored_keys: Vec<String>,
}

/// Reads `value` (the JSON, or `@FILE` holding it) and derives every rank's endpoints for
/// `dp_size` ranks. Errors are one line, without the `--kv-events-config` prefix.
pub(super) fn derive(
    value: &str,
    dp_size: u32,
    family: Option<EngineFamily>,
) -> Result<Derived, String> {
    let text = match value.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("{value}: {e}"))?,
        None => value.to_string(),
    };
    let cfg = parse(&text)?;
    check_publisher(&cfg, family)?;
    let ranks = match family {
        Some(f) => ranks_for(&cfg, dp_size, f)?,
        None => {
            // The same answer under every family's rules, or the user must say which engine.
            let plans = EngineFamily::ALL
                .iter()
                .map(|&f| ranks_for(&cfg, dp_size, f).map(|r| (f, r)))
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(why) = disagreement(&cfg, &plans) {
                return Err(format!(
                    "{why}; say which engine was given this configuration with --engine vllm|sglang|tokenspeed"
                ));
            }
            plans.into_iter().next().expect("three families").1
        }
    };
    check_ports(&cfg, dp_size)?;
    Ok(Derived {
        ranks,
        topic: cfg.topic,
        ignored_keys: cfg.ignored,
    })
}

fn parse(text: &str) -> Result<EngineKvConfig, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON ({e})"))?;
    let Value::Object(map) = value else {
        return Err(
            r#"expected a JSON object, e.g. {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}"#
                .into(),
        );
    };
    let get = |key: &str| map.get(key).filter(|v| !v.is_null());
    let string = |key: &str| -> Result<Option<String>, String> {
        match get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(format!("\"{key}\" must be a string, not {v}")),
        }
    };
    let boolean = |key: &str| -> Result<Option<bool>, String> {
        match get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(format!("\"{key}\" must be true or false, not {v}")),
        }
    };
    Ok(EngineKvConfig {
        enable_kv_cache_events: boolean("enable_kv_cache_events")?.unwrap_or(false),
        publisher: string("publisher")?,
        endpoint: string("endpoint")?.unwrap_or_else(|| DEFAULT_ENDPOINT.into()),
        // An empty replay endpoint is "none" to the engines as well.
        replay_endpoint: string("replay_endpoint")?.filter(|s| !s.is_empty()),
        snapshot_endpoint: string("snapshot_endpoint")?.filter(|s| !s.is_empty()),
        topic: string("topic")?.unwrap_or_default(),
        bind: boolean("bind")?,
        ignored: ignored_keys(&map),
    })
}

fn ignored_keys(map: &Map<String, Value>) -> Vec<String> {
    map.keys()
        .filter(|k| !KNOWN_KEYS.contains(&k.as_str()))
        .cloned()
        .collect()
}

/// Refuses a configuration under which the engine publishes nothing over ZMQ.
fn check_publisher(cfg: &EngineKvConfig, family: Option<EngineFamily>) -> Result<(), String> {
    if let Some(p) = cfg.publisher.as_deref() {
        if p != "zmq" && p != "null" {
            return Err(format!(
                "\"publisher\": {p:?} is not the ZMQ publisher kvbridge reads; set \"publisher\": \"zmq\""
            ));
        }
    }
    let publishes = |f: EngineFamily| match f {
        // vLLM ≥ 0.11.1 derives "zmq" from the switch; earlier releases need it spelled out.
        EngineFamily::Vllm | EngineFamily::Tokenspeed => {
            cfg.enable_kv_cache_events && cfg.publisher.as_deref() != Some("null")
        }
        EngineFamily::Sglang => cfg.publisher.as_deref() == Some("zmq"),
    };
    match family {
        Some(f) if !publishes(f) => Err(match f {
            EngineFamily::Vllm | EngineFamily::Tokenspeed => format!(
                "{f} publishes no events with this configuration; it needs \"enable_kv_cache_events\": true (and not \"publisher\": \"null\")"
            ),
            EngineFamily::Sglang => {
                format!("{f} publishes no events with this configuration; it needs \"publisher\": \"zmq\"")
            }
        }),
        None if !EngineFamily::ALL.into_iter().any(publishes) => Err(
            "no engine publishes events with this configuration; vLLM and TokenSpeed need \"enable_kv_cache_events\": true, SGLang needs \"publisher\": \"zmq\""
                .into(),
        ),
        _ => Ok(()),
    }
}

/// A ZMQ endpoint as the engine writes it.
enum Endpoint<'a> {
    Tcp { host: &'a str, port: u16 },
    Ipc,
}

fn endpoint_kind<'a>(key: &str, ep: &'a str) -> Result<Endpoint<'a>, String> {
    if let Some(rest) = ep.strip_prefix("tcp://") {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("\"{key}\": {ep:?}: expected tcp://HOST:PORT"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("\"{key}\": {ep:?}: bad port {port:?}"))?;
        if port == 0 {
            return Err(format!(
                "\"{key}\": {ep:?}: port 0 makes the engine pick a free port per rank; read the actual ports from the engine (vLLM: /kv_event_sources) and pass them with --zmq/--replay instead"
            ));
        }
        Ok(Endpoint::Tcp { host, port })
    } else if ep.starts_with("ipc://") {
        Ok(Endpoint::Ipc)
    } else if ep.starts_with("inproc://") {
        Err(format!(
            "\"{key}\": {ep:?}: inproc endpoints are reachable only inside the engine process; use tcp:// or ipc://"
        ))
    } else {
        Err(format!(
            "\"{key}\": {ep:?}: expected tcp://HOST:PORT or ipc://PATH"
        ))
    }
}

/// The endpoint of rank `r` (docs/engine-wire.md §2.2): the port after the last colon + `r`.
fn rank_endpoint(key: &str, ep: &str, r: u32, dp_size: u32) -> Result<String, String> {
    match endpoint_kind(key, ep)? {
        _ if r == 0 => Ok(ep.to_string()),
        Endpoint::Ipc => Err(format!(
            "\"{key}\": {ep:?}: the engine refuses ipc:// endpoints with more than one DP rank (--data-parallel-size {dp_size}); use tcp://HOST:PORT"
        )),
        Endpoint::Tcp { host, port } => {
            let p = u32::from(port) + r;
            if p > u32::from(u16::MAX) {
                return Err(format!(
                    "\"{key}\": {ep:?}: rank {r} would publish on port {p}, above 65535; choose a lower port"
                ));
            }
            Ok(format!("tcp://{host}:{p}"))
        }
    }
}

/// Whether `family`'s engine binds its PUB at `ep` (docs/engine-wire.md §2.1).
fn engine_binds(family: EngineFamily, ep: &str, bind: Option<bool>) -> bool {
    if let (EngineFamily::Sglang, Some(b)) = (family, bind) {
        return b;
    }
    ep.contains('*')
        || ep.contains("::")
        || ep.starts_with("ipc://")
        || ep.starts_with("inproc://")
        || (family == EngineFamily::Sglang && ep.contains("0.0.0.0"))
}

fn ranks_for(
    cfg: &EngineKvConfig,
    dp_size: u32,
    family: EngineFamily,
) -> Result<Vec<RankEndpoint>, String> {
    (0..dp_size)
        .map(|r| {
            let engine_ep = rank_endpoint("endpoint", &cfg.endpoint, r, dp_size)?;
            let bind = !engine_binds(family, &engine_ep, cfg.bind);
            let endpoint = validate_endpoint(&engine_ep, !bind)
                .map_err(|e| format!("\"endpoint\": {engine_ep:?}: {e}"))?;
            // The engine binds its replay and snapshot ROUTERs in every case; kvbridge connects.
            let router = |key: &str, ep: &Option<String>| match ep {
                Some(rep) => {
                    let engine_rep = rank_endpoint(key, rep, r, dp_size)?;
                    validate_endpoint(&engine_rep, true)
                        .map(Some)
                        .map_err(|e| format!("\"{key}\": {engine_rep:?}: {e}"))
                }
                None => Ok(None),
            };
            Ok(RankEndpoint {
                rank: r,
                endpoint,
                bind,
                replay: router("replay_endpoint", &cfg.replay_endpoint)?,
                snapshot: router("snapshot_endpoint", &cfg.snapshot_endpoint)?,
            })
        })
        .collect()
}

/// Why the families' plans differ, if they do (only who binds can differ).
fn disagreement(
    cfg: &EngineKvConfig,
    plans: &[(EngineFamily, Vec<RankEndpoint>)],
) -> Option<String> {
    let (_, first) = &plans[0];
    if plans.iter().all(|(_, p)| p == first) {
        return None;
    }
    let connecting = plans
        .iter()
        .filter(|(_, p)| p[0].bind)
        .map(|(f, _)| f.to_string())
        .collect::<Vec<_>>()
        .join(" and ");
    // Without `bind`, only SGLang's `0.0.0.0` rule sets the families apart (§2.1).
    let what = match cfg.bind {
        Some(b) => format!(
            "\"bind\": {b} is honoured by SGLang (since 0.5.22) only, the others decide from {:?}",
            cfg.endpoint
        ),
        None => format!(
            "{:?} is bound by SGLang (since 0.5.13) but connected to by {connecting}",
            cfg.endpoint
        ),
    };
    Some(format!("the engines disagree on who binds: {what}"))
}

/// Refuses overlapping event and replay ports: rank r uses `endpoint`'s port + r and
/// `replay_endpoint`'s port + r, so the default replay = PUB + 1 puts rank 0's replay on rank 1's
/// PUB port (docs/engine-wire.md §2.2), and the engine cannot bind both.
fn check_ports(cfg: &EngineKvConfig, dp_size: u32) -> Result<(), String> {
    let Some(rep) = &cfg.replay_endpoint else {
        return Ok(());
    };
    let (
        Endpoint::Tcp { port: pub_port, .. },
        Endpoint::Tcp {
            host: rep_host,
            port: rep_port,
        },
    ) = (
        endpoint_kind("endpoint", &cfg.endpoint)?,
        endpoint_kind("replay_endpoint", rep)?,
    )
    else {
        return Ok(());
    };
    let (p, q, n) = (u32::from(pub_port), u32::from(rep_port), dp_size);
    // Rank a's replay port q + a equals rank b's event port p + b.
    let clash = (0..n).find_map(|a| {
        let b = (q + a).checked_sub(p)?;
        (b < n).then_some((a, b))
    });
    let Some((a, b)) = clash else {
        return Ok(());
    };
    let fixed = p + n;
    let mut msg = format!(
        "rank {a}'s replay port {} is rank {b}'s event port: each rank r uses port {p} + r for events and {q} + r for replay, so with --data-parallel-size {n} the engine cannot bind both",
        q + a
    );
    if fixed <= u32::from(u16::MAX) {
        msg.push_str(&format!(
            "; give the engine and kvbridge \"replay_endpoint\": \"tcp://{rep_host}:{fixed}\" (no replay port may fall in {p}–{})",
            p + n - 1
        ));
    }
    Err(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(json: &str, dp: u32, f: Option<EngineFamily>) -> Derived {
        derive(json, dp, f).unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    fn err(json: &str, dp: u32, f: Option<EngineFamily>) -> String {
        match derive(json, dp, f) {
            Ok(d) => panic!("{json}: accepted as {d:?}"),
            Err(e) => {
                assert!(!e.contains('\n'), "one line: {e}");
                e
            }
        }
    }

    fn plan(d: &Derived) -> Vec<(String, bool, Option<String>)> {
        d.ranks
            .iter()
            .map(|r| (r.endpoint.clone(), r.bind, r.replay.clone()))
            .collect()
    }

    fn conn(ep: &str, replay: Option<&str>) -> (String, bool, Option<String>) {
        (ep.into(), false, replay.map(str::to_string))
    }

    fn bind(ep: &str, replay: Option<&str>) -> (String, bool, Option<String>) {
        (ep.into(), true, replay.map(str::to_string))
    }

    /// vLLM's `KVEventsConfig` defaults (vllm/config/kv_events.py): `enable_kv_cache_events`
    /// false, `publisher` derived ("zmq" when enabled), endpoint `tcp://*:5557`, replay None,
    /// topic "". The switch alone gives one connecting rank without replay.
    #[test]
    fn vllm_defaults() {
        let d = ok(
            r#"{"enable_kv_cache_events": true}"#,
            1,
            Some(EngineFamily::Vllm),
        );
        assert_eq!(plan(&d), [conn("tcp://127.0.0.1:5557", None)]);
        assert_eq!(d.topic, "");
        assert!(d.ignored_keys.is_empty());
        // Every field written out with its default value means the same.
        let full = r#"{"enable_kv_cache_events": true, "publisher": null, "endpoint": "tcp://*:5557",
            "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""}"#;
        assert_eq!(plan(&ok(full, 1, Some(EngineFamily::Vllm))), plan(&d));
        // The switch off (the default): nothing is published.
        let e = err("{}", 1, Some(EngineFamily::Vllm));
        assert!(e.contains("\"enable_kv_cache_events\": true"), "{e}");
        let e = err(
            r#"{"enable_kv_cache_events": true, "publisher": "null"}"#,
            1,
            Some(EngineFamily::Vllm),
        );
        assert!(e.contains("vLLM publishes no events"), "{e}");
    }

    /// vLLM with DP: every rank on port + rank, replay likewise, topic passed on.
    #[test]
    fn vllm_data_parallel() {
        let d = ok(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:6557", "topic": "kv"}"#,
            3,
            None,
        );
        assert_eq!(
            plan(&d),
            [
                conn("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:6557")),
                conn("tcp://127.0.0.1:5558", Some("tcp://127.0.0.1:6558")),
                conn("tcp://127.0.0.1:5559", Some("tcp://127.0.0.1:6559")),
            ]
        );
        assert_eq!(d.topic, "kv");
        assert_eq!(
            d.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
            [0, 1, 2]
        );
    }

    /// vLLM #57789's `snapshot_endpoint` (unmerged): port + rank like the replay endpoint.
    #[test]
    fn vllm_snapshot_endpoint_per_rank() {
        let d = ok(
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:6557", "snapshot_endpoint": "tcp://*:7557"}"#,
            2,
            Some(EngineFamily::Vllm),
        );
        let snaps: Vec<_> = d.ranks.iter().map(|r| r.snapshot.clone()).collect();
        assert_eq!(
            snaps,
            [
                Some("tcp://127.0.0.1:7557".to_string()),
                Some("tcp://127.0.0.1:7558".to_string())
            ]
        );
        assert!(d.ignored_keys.is_empty(), "{:?}", d.ignored_keys);
    }

    /// vLLM connects to `0.0.0.0` and to concrete hosts: kvbridge binds there.
    #[test]
    fn vllm_connects_to_concrete_hosts_and_0000() {
        let d = ok(
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://0.0.0.0:5557"}"#,
            2,
            Some(EngineFamily::Vllm),
        );
        assert_eq!(
            plan(&d),
            [
                bind("tcp://0.0.0.0:5557", None),
                bind("tcp://0.0.0.0:5558", None)
            ]
        );
        let d = ok(
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:7000", "replay_endpoint": "tcp://*:7100"}"#,
            2,
            None,
        );
        assert_eq!(
            plan(&d),
            [
                bind("tcp://127.0.0.1:7000", Some("tcp://127.0.0.1:7100")),
                bind("tcp://127.0.0.1:7001", Some("tcp://127.0.0.1:7101")),
            ]
        );
        // IPv6: every literal containing "::" is bound by the engine.
        let d = ok(
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://[::]:5557"}"#,
            2,
            None,
        );
        assert_eq!(
            plan(&d),
            [
                conn("tcp://[::1]:5557", None),
                conn("tcp://[::1]:5558", None)
            ]
        );
    }

    /// SGLang's `KVEventsConfig` defaults (python/sglang/srt/disaggregation/kv_events.py):
    /// `publisher` "null", endpoint `tcp://*:5557`, replay None, topic "".
    #[test]
    fn sglang_defaults() {
        let e = err("{}", 1, Some(EngineFamily::Sglang));
        assert!(e.contains("\"publisher\": \"zmq\""), "{e}");
        // `enable_kv_cache_events` does not switch SGLang on.
        let e = err(
            r#"{"enable_kv_cache_events": true}"#,
            1,
            Some(EngineFamily::Sglang),
        );
        assert!(e.contains("SGLang publishes no events"), "{e}");
        let d = ok(r#"{"publisher": "zmq"}"#, 1, None);
        assert_eq!(plan(&d), [conn("tcp://127.0.0.1:5557", None)]);
        assert_eq!(d.topic, "");
        let full = r#"{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null,
            "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""}"#;
        assert_eq!(plan(&ok(full, 1, Some(EngineFamily::Sglang))), plan(&d));
    }

    /// SGLang with DP (attn_dp_rank offsets): as vLLM; `0.0.0.0` is bound (≥ 0.5.13), and an
    /// explicit `bind` wins (≥ 0.5.22).
    #[test]
    fn sglang_data_parallel_0000_and_bind() {
        let d = ok(
            r#"{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"}"#,
            2,
            Some(EngineFamily::Sglang),
        );
        assert_eq!(
            plan(&d),
            [
                conn("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:5600")),
                conn("tcp://127.0.0.1:5558", Some("tcp://127.0.0.1:5601")),
            ]
        );
        let d = ok(
            r#"{"publisher": "zmq", "endpoint": "tcp://0.0.0.0:5557"}"#,
            2,
            Some(EngineFamily::Sglang),
        );
        assert_eq!(
            plan(&d),
            [
                conn("tcp://127.0.0.1:5557", None),
                conn("tcp://127.0.0.1:5558", None)
            ]
        );
        let d = ok(
            r#"{"publisher": "zmq", "endpoint": "tcp://10.0.0.7:5557", "bind": true}"#,
            1,
            Some(EngineFamily::Sglang),
        );
        assert_eq!(plan(&d), [conn("tcp://10.0.0.7:5557", None)]);
        let d = ok(
            r#"{"publisher": "zmq", "endpoint": "tcp://*:5557", "bind": false}"#,
            1,
            Some(EngineFamily::Sglang),
        );
        assert_eq!(plan(&d), [bind("tcp://*:5557", None)]);
        // vLLM ignores `bind`.
        let d = ok(
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.7:5557", "bind": true}"#,
            1,
            Some(EngineFamily::Vllm),
        );
        assert_eq!(plan(&d), [bind("tcp://10.0.0.7:5557", None)]);
    }

    /// TokenSpeed: switched on like vLLM, bind rule of the generic heuristic.
    #[test]
    fn tokenspeed() {
        let d = ok(
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}"#,
            2,
            Some(EngineFamily::Tokenspeed),
        );
        assert_eq!(
            plan(&d),
            [
                conn("tcp://127.0.0.1:5557", None),
                conn("tcp://127.0.0.1:5558", None)
            ]
        );
        let e = err(r#"{"publisher": "zmq"}"#, 1, Some(EngineFamily::Tokenspeed));
        assert!(e.contains("TokenSpeed publishes no events"), "{e}");
    }

    #[test]
    fn where_the_families_disagree_the_engine_must_be_named() {
        let e = err(
            r#"{"publisher": "zmq", "enable_kv_cache_events": true, "endpoint": "tcp://0.0.0.0:5557"}"#,
            1,
            None,
        );
        assert!(
            e.contains("is bound by SGLang (since 0.5.13) but connected to by vLLM and TokenSpeed"),
            "{e}"
        );
        assert!(e.contains("--engine vllm|sglang|tokenspeed"), "{e}");
        let e = err(
            r#"{"publisher": "zmq", "endpoint": "tcp://10.0.0.7:5557", "bind": true}"#,
            1,
            None,
        );
        assert!(e.contains("\"bind\": true"), "{e}");
        // A `bind` that agrees with the endpoint string changes nothing.
        ok(
            r#"{"publisher": "zmq", "endpoint": "tcp://*:5557", "bind": true}"#,
            1,
            None,
        );
    }

    /// The engine's default replay port (PUB + 1) is rank 1's PUB port.
    #[test]
    fn replay_port_colliding_with_the_next_rank_is_refused_with_the_fix() {
        let json = r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}"#;
        ok(json, 1, None);
        let e = err(json, 2, None);
        assert_eq!(
            e,
            "rank 0's replay port 5558 is rank 1's event port: each rank r uses port 5557 + r for events \
             and 5558 + r for replay, so with --data-parallel-size 2 the engine cannot bind both; give the \
             engine and kvbridge \"replay_endpoint\": \"tcp://*:5559\" (no replay port may fall in 5557–5558)"
        );
        // The suggested fix works; so does a replay range below the event range.
        ok(&json.replace("5558", "5559"), 2, None);
        ok(&json.replace("5558", "5555"), 2, None);
        let e = err(&json.replace("5558", "5556"), 2, None);
        assert!(
            e.starts_with("rank 1's replay port 5557 is rank 0's event port"),
            "{e}"
        );
        let e = err(&json.replace("5558", "5557"), 1, None);
        assert!(
            e.starts_with("rank 0's replay port 5557 is rank 0's"),
            "{e}"
        );
    }

    #[test]
    fn what_the_engine_cannot_do_is_refused() {
        let on = |rest: &str| format!(r#"{{"enable_kv_cache_events": true, {rest}}}"#);
        for (json, dp, want) in [
            (
                on(r#""endpoint": "ipc:///tmp/kv""#),
                2,
                "more than one DP rank",
            ),
            (on(r#""endpoint": "inproc://kv""#), 1, "inproc"),
            (on(r#""endpoint": "tcp://*:0""#), 1, "port 0"),
            (on(r#""endpoint": "tcp://*:65535""#), 2, "above 65535"),
            (on(r#""endpoint": "udp://x:1""#), 1, "expected tcp://"),
            (
                on(r#""replay_endpoint": "ipc:///tmp/r""#),
                2,
                "more than one DP rank",
            ),
            (on(r#""publisher": "kafka""#), 1, "\"publisher\": \"kafka\""),
            (
                on(r#""endpoint": 5557"#),
                1,
                "\"endpoint\" must be a string",
            ),
            (on(r#""bind": "yes""#), 1, "\"bind\" must be true or false"),
            ("[1]".into(), 1, "expected a JSON object"),
            ("{".into(), 1, "not valid JSON"),
            ("{}".into(), 1, "no engine publishes events"),
        ] {
            let e = err(&json, dp, None);
            assert!(e.contains(want), "{json}: {e}");
        }
        // ipc with one rank: the engine binds, kvbridge connects to the same path.
        let d = ok(&on(r#""endpoint": "ipc:///tmp/kv""#), 1, None);
        assert_eq!(plan(&d), [conn("ipc:///tmp/kv", None)]);
    }

    #[test]
    fn json_from_a_file_and_unknown_keys() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("kv.json");
        std::fs::write(
            &p,
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "endpont": "x"}"#,
        )
        .unwrap();
        let d = ok(&format!("@{}", p.display()), 1, None);
        assert_eq!(plan(&d), [conn("tcp://127.0.0.1:6000", None)]);
        assert_eq!(d.ignored_keys, ["endpont"]);
        let e = err(&format!("@{}", dir.path().join("none").display()), 1, None);
        assert!(e.contains("none"), "{e}");
    }
}
