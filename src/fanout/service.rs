//! The tonic side: the four generated servers (from `proto/services/`), all delegating to one
//! [`Fanout`], plus the HTTP/2 settings SMG gateways need (smg-api.md §3.1).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use tonic::{Request, Response, Status};

use super::{code_label, EncodedBatch, Fanout, DP_RANK_HEADER};
use crate::proto::common::SubscribeKvEventsRequest;

/// Server code generated with `KvEventBatch` mapped to [`EncodedBatch`] (see `build.rs`).
#[allow(missing_docs, clippy::all)]
mod generated {
    pub mod sglang {
        include!(concat!(env!("OUT_DIR"), "/server/sglang.grpc.scheduler.rs"));
    }
    pub mod vllm {
        include!(concat!(env!("OUT_DIR"), "/server/vllm.grpc.engine.rs"));
    }
    pub mod tokenspeed {
        include!(concat!(
            env!("OUT_DIR"),
            "/server/tokenspeed.grpc.scheduler.rs"
        ));
    }
    pub mod trtllm {
        include!(concat!(env!("OUT_DIR"), "/server/trtllm.rs"));
    }
}
use generated::*;

/// The response stream of every path.
pub type BatchStream = Pin<Box<dyn Stream<Item = Result<EncodedBatch, Status>> + Send + 'static>>;

/// One handle per path, so that metrics can tell the paths apart.
#[derive(Clone)]
pub struct PathHandler {
    fanout: Arc<Fanout>,
    path: &'static str,
}

impl PathHandler {
    fn open(
        &self,
        req: Request<SubscribeKvEventsRequest>,
    ) -> Result<Response<BatchStream>, Status> {
        let rank = req
            .metadata()
            .get(DP_RANK_HEADER)
            .map(|v| v.as_bytes().to_vec());
        let start = req.get_ref().start_sequence_number;
        let sub = self.fanout.subscribe(self.path, start, rank.as_deref())?;
        tracing::debug!(path = self.path, start, "subscription opened");
        let metrics = self.fanout.metrics.clone();
        let latency = metrics.send_latency.with_label_values(&[self.path]);
        let stream = futures_util::stream::unfold(sub, move |mut sub| {
            let metrics = metrics.clone();
            let latency = latency.clone();
            async move {
                let item = sub.next_batch().await?;
                match &item {
                    Ok(b) => {
                        metrics.batches_sent.inc();
                        metrics.bytes_sent.inc_by(b.0.len() as u64);
                        let _ = &latency;
                    }
                    Err(s) => {
                        metrics
                            .statuses
                            .with_label_values(&[code_label(s.code())])
                            .inc();
                        if s.code() == tonic::Code::DataLoss {
                            metrics.resumes.with_label_values(&["data_loss"]).inc();
                        }
                    }
                }
                Some((item, sub))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

macro_rules! impl_path {
    ($module:ident :: $server_mod:ident :: $trait_:ident) => {
        #[tonic::async_trait]
        impl $module::$server_mod::$trait_ for PathHandler {
            type SubscribeKvEventsStream = BatchStream;
            async fn subscribe_kv_events(
                &self,
                request: Request<SubscribeKvEventsRequest>,
            ) -> Result<Response<BatchStream>, Status> {
                self.open(request)
            }
        }
    };
}

impl_path!(sglang::sglang_scheduler_server::SglangScheduler);
impl_path!(vllm::vllm_engine_server::VllmEngine);
impl_path!(tokenspeed::token_speed_scheduler_server::TokenSpeedScheduler);
impl_path!(trtllm::trtllm_service_server::TrtllmService);

/// A tonic router serving `SubscribeKvEvents` on all four SMG paths, identically.
pub fn router(fanout: Arc<Fanout>) -> tonic::transport::server::Router {
    let h = |path: &'static str| PathHandler {
        fanout: fanout.clone(),
        path,
    };
    let p = crate::proto::SUBSCRIBE_PATHS;
    // Records are kept under 4 MiB by the decoder's split threshold; the encode limit is left
    // at tonic's default (unlimited) so a limit here can never turn a valid record into an error.
    server_builder()
        .add_service(sglang::sglang_scheduler_server::SglangSchedulerServer::new(
            h(p[0]),
        ))
        .add_service(vllm::vllm_engine_server::VllmEngineServer::new(h(p[1])))
        .add_service(
            tokenspeed::token_speed_scheduler_server::TokenSpeedSchedulerServer::new(h(p[2])),
        )
        .add_service(trtllm::trtllm_service_server::TrtllmServiceServer::new(h(
            p[3],
        )))
}

/// Transport settings: SMG pings every 30 s even when idle, so pings are accepted (tonic does not
/// enforce a ping policy), and kvbridge pings its peers too, to reap dead subscriptions.
fn server_builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .tcp_keepalive(Some(Duration::from_secs(60)))
}

/// Serves on an already-bound listener until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    fanout: Arc<Fanout>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    router(fanout)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
