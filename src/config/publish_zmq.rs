//! Re-publishing on the engines' own ZMQ wire, validated into that edge's settings
//! ([`crate::publish_zmq::PublishZmqConfig`]).

use serde::Deserialize;

use super::{invalid, ConfigError, Merge};

concern! {
    /// Re-publishing on the engines' own ZMQ wire (docs/dynamo-llm-d.md).
    #[command(next_help_heading = "Engine-wire publishing (ZMQ)")]
    pub struct PublishZmqArgs {
        /// Bind a ZMQ PUB per DP rank, rank r on PORT + r, carrying every ring record as the
        /// engine's own `[topic, seq, EventBatch]` (for Dynamo, llm-d and other ZMQ consumers).
        #[arg(long, value_name = "tcp://HOST:PORT")]
        pub publish_zmq: Option<String>,
        /// Also bind the replay ROUTER of rank r on PORT + r (the vLLM replay protocol).
        #[arg(long, value_name = "tcp://HOST:PORT")]
        pub publish_zmq_replay: Option<String>,
        /// Serve vLLM #57789's wire (unmerged): bind its snapshot ROUTER for rank r on PORT + r,
        /// answering from the snapshot table; live seq frames carry the ring's 16-byte identity,
        /// and an idle rank sends an empty batch every second.
        #[arg(long, value_name = "tcp://HOST:PORT")]
        pub publish_zmq_snapshot: Option<String>,
        /// Topic frame of published batches.
        #[arg(long, value_name = "TOPIC")]
        pub publish_zmq_topic: Option<String>,
        /// Event encoding: tagged maps (vLLM >= 0.24) or tagged arrays (older consumers).
        #[arg(long, value_enum)]
        pub publish_zmq_layout: Option<crate::publish_zmq::WireLayout>,
        /// Messages queued for one subscriber connection before the PUB drops that subscriber's
        /// messages (it sees a seq gap and replays); bounds what a subscriber that never reads
        /// makes kvbridge hold.
        #[arg(long, value_name = "N")]
        pub publish_zmq_hwm: Option<u32>,
    }
}

impl PublishZmqArgs {
    pub(super) fn validate(
        self,
    ) -> Result<Option<crate::publish_zmq::PublishZmqConfig>, ConfigError> {
        use crate::publish_zmq::{PublishZmqConfig, TcpEndpoint, DEFAULT_PUB_HWM, MAX_PUB_HWM};
        let Some(publish) = self.publish_zmq else {
            for (name, given) in [
                ("publish-zmq-replay", self.publish_zmq_replay.is_some()),
                ("publish-zmq-snapshot", self.publish_zmq_snapshot.is_some()),
                ("publish-zmq-topic", self.publish_zmq_topic.is_some()),
                ("publish-zmq-layout", self.publish_zmq_layout.is_some()),
                ("publish-zmq-hwm", self.publish_zmq_hwm.is_some()),
            ] {
                if given {
                    return Err(invalid(format!("--{name} needs --publish-zmq")));
                }
            }
            return Ok(None);
        };
        let publish = TcpEndpoint::parse("publish-zmq", &publish).map_err(invalid)?;
        let replay = match &self.publish_zmq_replay {
            Some(r) => Some(TcpEndpoint::parse("publish-zmq-replay", r).map_err(invalid)?),
            None => None,
        };
        let snapshot = match &self.publish_zmq_snapshot {
            Some(r) => Some(TcpEndpoint::parse("publish-zmq-snapshot", r).map_err(invalid)?),
            None => None,
        };
        let hwm = self.publish_zmq_hwm.unwrap_or(DEFAULT_PUB_HWM);
        if !(1..=MAX_PUB_HWM).contains(&hwm) {
            return Err(invalid(format!(
                "--publish-zmq-hwm {hwm}: must be between 1 and {MAX_PUB_HWM}"
            )));
        }
        Ok(Some(PublishZmqConfig {
            publish,
            replay,
            snapshot,
            topic: self.publish_zmq_topic,
            layout: self.publish_zmq_layout.unwrap_or_default(),
            hwm,
        }))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::flags;

    #[test]
    fn publish_zmq_settings_are_checked() {
        let err = |a: &[&str]| {
            let mut v = vec!["--zmq", "tcp://*:5557"];
            v.extend_from_slice(a);
            flags(&v).resolve().unwrap_err().to_string()
        };
        assert_eq!(
            err(&["--publish-zmq-topic", "kv"]),
            "--publish-zmq-topic needs --publish-zmq"
        );
        assert_eq!(
            err(&["--publish-zmq-hwm", "5"]),
            "--publish-zmq-hwm needs --publish-zmq"
        );
        assert!(
            err(&["--publish-zmq", "tcp://*:6000", "--publish-zmq-hwm", "0"])
                .contains("between 1 and")
        );
        assert!(err(&["--publish-zmq", "ipc:///x"]).contains("must be tcp://HOST:PORT"));
        assert!(err(&["--publish-zmq", "tcp://*:70000"]).contains("0 to 65535"));
        assert!(err(&["--publish-zmq", "tcp://:6000"]).contains("no host"));
        let two = |extra: &[&str]| {
            let mut v = vec!["--zmq", "tcp://*:5557", "--zmq", "tcp://*:5567"];
            v.extend_from_slice(extra);
            flags(&v).resolve().map(|_| ()).map_err(|e| e.to_string())
        };
        assert!(two(&["--publish-zmq", "tcp://*:6000"])
            .unwrap_err()
            .contains("needs --dp-mode metadata"));
        let clash = two(&[
            "--dp-mode",
            "metadata",
            "--publish-zmq",
            "tcp://*:6000",
            "--publish-zmq-replay",
            "tcp://*:6001",
        ])
        .unwrap_err();
        assert!(clash.contains("overlap"), "{clash}");
        two(&[
            "--dp-mode",
            "metadata",
            "--publish-zmq",
            "tcp://*:6000",
            "--publish-zmq-replay",
            "tcp://*:6002",
        ])
        .unwrap();
        assert!(
            two(&["--dp-mode", "metadata", "--publish-zmq", "tcp://*:65535"])
                .unwrap_err()
                .contains("beyond 65535")
        );
    }
}
