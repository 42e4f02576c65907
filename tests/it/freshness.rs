//! Freshness per rank (docs/operations.md, "Freshness"): a kvbridge that starts after the
//! engine's replay buffer has dropped the start of its history says its rank is **degraded**
//! (metric, `/health`, one log line), keeps saying so across its own SIGKILL and restart on the
//! same ring (the ring's writer notes), and says **exact** again once the engine's own cache
//! reset is in the stream. Before, an operator could not tell "idle" from "not fed": the
//! stream looked the same either way.

use crate::common;

use std::time::Duration;

use common::*;
use kvbridge_tools::sim::{Layout, SimEvent};

const T: Duration = Duration::from_secs(30);

fn degraded(page: &str, cause: &str) -> bool {
    metric(page, "kvbridge_rank_exact", &[("rank", "0")]) == 0.0
        && metric(
            page,
            "kvbridge_rank_degraded",
            &[("rank", "0"), ("cause", cause)],
        ) == 1.0
}

fn exact(page: &str) -> bool {
    metric(page, "kvbridge_rank_exact", &[("rank", "0")]) == 1.0
        && metric(page, "kvbridge_rank_degraded", &[("rank", "0")]) == 0.0
}

#[test]
fn missing_history_is_degraded_until_the_engines_reset_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("ring");
    let e = Engine::start(0);
    // The engine keeps two batches for replay and has published five: the first three (its
    // stores) are gone for anyone who starts now.
    e.with(|p| p.set_buffer_steps(2));
    for i in 0..5 {
        e.publish(Layout::Vllm033, vec![store(100 + i, 1, None)], 0);
    }
    let (b, addr) = Bridge::start_with_metrics(dir.path(), &shm, &e.bridge_args());
    e.wait_subscribed();
    // Every series exists from the start, before anything is known.
    let page = scrape(addr);
    for cause in [
        "missing_history",
        "unfillable_gap",
        "undecodable",
        "replay_overflow",
        "lost_removal",
        "unknown_group",
    ] {
        assert!(
            page.contains(&format!(
                "kvbridge_rank_degraded{{cause=\"{cause}\",rank=\"0\"}}"
            )),
            "{cause} series missing at start:\n{page}"
        );
    }
    e.publish(Layout::Vllm033, vec![store(200, 1, None)], 0);
    wait_metrics(addr, T, |p| degraded(p, "missing_history"));
    let health = http_get(addr, "/health");
    assert!(
        health.contains(
            r#"{"rank":0,"connected":1,"freshness":"degraded","cause":"missing_history","causes":["missing_history"]}"#
        ),
        "{health}"
    );
    assert!(
        health.contains(r#""serving":true"#),
        "degraded is still SERVING: {health}"
    );
    let log = b.log();
    assert!(
        log.contains("rank output degraded") && log.contains("missing_history"),
        "one log line says so:\n{log}"
    );

    // A restart of kvbridge does not forget it: the engine has not reset its cache meanwhile.
    b.kill();
    let (b, addr) = Bridge::start_with_metrics(dir.path(), &shm, &e.bridge_args());
    // The very first answers already know it: the ring's notes are read before anything serves.
    let health = http_get(addr, "/health");
    assert!(
        health.contains(r#""freshness":"degraded","cause":"missing_history""#),
        "{health}"
    );
    let page = scrape(addr);
    assert!(degraded(&page, "missing_history"), "{page}");
    assert!(
        b.log().contains("kept in the ring"),
        "the restart says where it knows it from:\n{}",
        b.log()
    );

    // The engine's own reset: what follows is its whole state again.
    e.wait_subscribed_after(1);
    e.publish(Layout::Vllm033, vec![SimEvent::Cleared], 0);
    wait_metrics(addr, T, exact);
    let health = http_get(addr, "/health");
    assert!(
        health.contains(r#""freshness":"exact","cause":null,"causes":[]"#),
        "{health}"
    );
    assert!(b.log().contains("rank output exact again"), "{}", b.log());
    b.stop();
}
