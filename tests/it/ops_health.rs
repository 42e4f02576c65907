//! Operations: the gRPC health service follows the engine's connection, and server reflection
//! lists every service. The real binary, a simulated engine over real ZMQ, tonic clients.

use crate::common;

use common::ops::*;
use common::*;

async fn health_status(url: &str) -> i32 {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let mut c = HealthClient::new(channel(url).await);
    c.check(HealthCheckRequest {
        service: String::new(),
    })
    .await
    .unwrap()
    .into_inner()
    .status
}

async fn wait_health(url: &str, want: tonic_health::ServingStatus) {
    common::eventually_async(&format!("health is {want:?}"), T, || async {
        let st = health_status(url).await;
        if st == want as i32 {
            Ok(())
        } else {
            Err(st)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_flips_with_the_upstream_and_counts_disconnects() {
    use tonic_health::ServingStatus::{NotServing, Serving};
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let (ep, rp) = (e.endpoint.clone(), e.replay.clone());
    let mut args = engine_args(&e);
    args.extend([s("--health-grace-ms"), s("300")]);
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);
    // SERVING from the start-up grace alone is not the engine's connection (on a busy machine
    // the grace can end before the engine connects, and NOT_SERVING would then follow without
    // any disconnect): wait for the connection itself.
    wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_upstream_connected", &[("rank", "0")]) == 1.0
    });
    wait_health(&bridge.url(), Serving).await;
    // The per-service status follows too.
    {
        use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
        let mut c = HealthClient::new(channel(&bridge.url()).await);
        let st = c
            .check(HealthCheckRequest {
                service: s("vllm.grpc.engine.VllmEngine"),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(st, Serving as i32);
    }
    drop(e);
    wait_health(&bridge.url(), NotServing).await;
    let page = scrape(maddr);
    assert_eq!(
        metric(
            &page,
            "kvbridge_publisher_disconnects_total",
            &[("rank", "0")]
        ),
        1.0
    );
    assert_eq!(
        metric(&page, "kvbridge_upstream_connected", &[("rank", "0")]),
        0.0
    );
    assert_eq!(metric(&page, "kvbridge_health_serving", &[]), 0.0);

    let e = Engine::start_at(&ep, &rp);
    wait_health(&bridge.url(), Serving).await;
    // Events flow again after the engine came back (its seq restarted at 0).
    let mut sub = subscribe(&bridge.url(), 0).await.unwrap();
    let want = publish_stores(&e, 7, 2, 2);
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= want.len()).await;
    assert_eq!(stored_hashes(&got), want);
    let page = scrape(maddr);
    assert_eq!(
        metric(&page, "kvbridge_publisher_connects_total", &[("rank", "0")]),
        2.0
    );
    assert_eq!(
        metric(&page, "kvbridge_upstream_connected", &[("rank", "0")]),
        1.0
    );
    drop(sub);
    bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_four_services_and_health() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &engine_args(&e));
    let mut c = ServerReflectionClient::new(channel(&bridge.url()).await);
    let list = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let symbol = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(s(
            "sglang.grpc.scheduler.SglangScheduler",
        ))),
    };
    let mut resp = c
        .server_reflection_info(tokio_stream::iter(vec![list, symbol]))
        .await
        .unwrap()
        .into_inner();
    let first = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(l)) = first.message_response else {
        panic!("unexpected reflection answer {first:?}");
    };
    let names: Vec<String> = l.service.into_iter().map(|s| s.name).collect();
    for want in [
        "sglang.grpc.scheduler.SglangScheduler",
        "vllm.grpc.engine.VllmEngine",
        "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
        "trtllm.TrtllmService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }
    let second = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(f)) = second.message_response else {
        panic!("unexpected reflection answer {second:?}");
    };
    assert!(!f.file_descriptor_proto.is_empty());
    // v1alpha answers too (older grpcurl).
    {
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as C;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as M;
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest as R;
        let mut c = C::new(channel(&bridge.url()).await);
        let mut r = c
            .server_reflection_info(tokio_stream::iter(vec![R {
                host: String::new(),
                message_request: Some(M::ListServices(String::new())),
            }]))
            .await
            .unwrap()
            .into_inner();
        assert!(r.message().await.unwrap().is_some());
    }
    bridge.stop();
}
