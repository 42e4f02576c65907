//! The started parts of a service, stopped newest first.

use std::future::Future;
use std::pin::Pin;

type Stop = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// What has been started, each with its one way to stop. A part is pushed right after it
/// started, so that a later part failing to start stops exactly what is running.
#[derive(Default)]
pub(super) struct Parts {
    started: Vec<(&'static str, Stop)>,
}

impl Parts {
    /// `name` is running; `stop` stops it (and returns when it has stopped).
    pub(super) fn started<F, Fut>(&mut self, name: &'static str, stop: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.started
            .push((name, Box::new(move || Box::pin(stop()))));
    }

    /// `name` is running; `stop` stops it by blocking (joining threads): run off the runtime.
    pub(super) fn started_blocking(
        &mut self,
        name: &'static str,
        stop: impl FnOnce() + Send + 'static,
    ) {
        self.started(name, move || async move {
            if let Err(e) = tokio::task::spawn_blocking(stop).await {
                tracing::warn!(part = name, error = %e, "stopping a part failed");
            }
        });
    }

    /// Stops every part, the newest first.
    pub(super) async fn stop_all(mut self) {
        while let Some((name, stop)) = self.started.pop() {
            tracing::debug!(part = name, "stopping");
            stop().await;
        }
    }
}
