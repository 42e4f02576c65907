//! The cheap client side of the bench: raw-bytes gRPC subscribers that read only the sequence
//! number and timestamp of each batch, and the timestamp patch of pre-encoded engine batches.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use hdrhistogram::Histogram;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

use super::Delivery;
use kvbridge::proto::common::SubscribeKvEventsRequest;

/// Writes `ts` into an engine batch encoded as `[ts, events, …]` with a float64 `ts`.
pub(super) fn patch_ts(batch: &mut [u8], ts: f64) {
    if batch.len() >= 10 && batch[1] == 0xcb {
        batch[2..10].copy_from_slice(&ts.to_be_bytes());
    }
}

/// `sequence_number` (field 1) and `timestamp` (field 2) of an encoded `KvEventBatch`, which
/// kvbridge always writes first and in that order.
pub(super) fn seq_and_ts(b: &[u8]) -> Option<(u64, f64)> {
    let mut buf = b;
    if buf.first() != Some(&0x08) {
        return None;
    }
    buf.advance(1);
    let seq = prost::encoding::decode_varint(&mut buf).ok()?;
    let ts = if buf.first() == Some(&0x11) && buf.len() >= 9 {
        f64::from_le_bytes(buf[1..9].try_into().ok()?)
    } else {
        0.0
    };
    Some((seq, ts))
}

/// A `SubscribeKvEvents` client codec that leaves each response as the exact bytes on the
/// wire: requests encode with prost, responses are not decoded. The bench reads only the
/// sequence number and timestamp from them; tests compare them byte for byte with the ring.
#[derive(Clone, Copy, Default, Debug)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = SubscribeKvEventsRequest;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = SubscribeKvEventsRequest;
    type Error = Status;
    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n)))
    }
}

/// What one subscriber saw.
pub(super) struct SubOut {
    /// Latency in ns from the scheduled send time.
    pub hist: Histogram<u64>,
    /// Counts.
    pub delivery: Delivery,
    /// Bytes received while measuring.
    pub bytes: u64,
}

/// One subscriber on the vLLM path, counting only while `measuring`.
pub(super) async fn subscriber(
    ch: tonic::transport::Channel,
    stop: Arc<AtomicBool>,
    measuring: Arc<AtomicBool>,
) -> SubOut {
    let mut out = SubOut {
        hist: Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("bounds"),
        delivery: Delivery::default(),
        bytes: 0,
    };
    let mut grpc = tonic::client::Grpc::new(ch);
    if grpc.ready().await.is_err() {
        out.delivery.errors += 1;
        return out;
    }
    let path = http::uri::PathAndQuery::from_static(kvbridge::proto::ENGINE_SERVICES[0].path);
    // Start at the head: the bench measures live delivery, not a replay of the window.
    let req = SubscribeKvEventsRequest {
        start_sequence_number: 0,
        load_records_before_first_batch: false,
    };
    let mut stream = match grpc
        .server_streaming(tonic::Request::new(req), path, RawCodec)
        .await
    {
        Ok(r) => r.into_inner(),
        Err(_) => {
            out.delivery.errors += 1;
            return out;
        }
    };
    let mut last: Option<u64> = None;
    while !stop.load(Ordering::Relaxed) {
        tokio::select! {
            m = stream.message() => match m {
                Ok(Some(b)) => {
                    let now = kvbridge::clock::unix_seconds();
                    let Some((seq, ts)) = seq_and_ts(&b) else { continue };
                    let counting = measuring.load(Ordering::Relaxed);
                    if let Some(l) = last {
                        if seq <= l {
                            if counting { out.delivery.duplicates += 1; }
                            continue;
                        }
                        if seq > l + 1 && counting {
                            out.delivery.lost += seq - l - 1;
                        }
                    }
                    last = Some(seq);
                    if counting {
                        out.delivery.delivered += 1;
                        out.bytes += b.len() as u64;
                        let _ = out.hist.record((((now - ts) * 1e9).max(1.0)) as u64);
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    if !stop.load(Ordering::Relaxed) {
                        out.delivery.errors += 1;
                    }
                    break;
                }
            },
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                if stop.load(Ordering::Relaxed) { break; }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_head_of_a_batch() {
        let b = kvbridge::proto::common::KvEventBatch {
            sequence_number: 300,
            timestamp: 1.5,
            ..Default::default()
        }
        .encode_to_vec();
        assert_eq!(seq_and_ts(&b), Some((300, 1.5)));
        let mut batch = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0x00];
        patch_ts(&mut batch, 2.25);
        assert_eq!(&batch[2..10], &2.25f64.to_be_bytes());
    }
}
