//! HTTP/2 flow control on the gRPC edge, where one task serves a connection and every stream it
//! carries: a stream whose window is full gets nothing more until the client opens it again
//! (its records wait in the ring), and meanwhile the other streams of the same connection get
//! every record. Seen with a raw HTTP/2 client that sets its own windows.

use crate::common;

use common::raw_h2::{self, arrived, batches, read_after};
use common::*;

const RECORDS: usize = 200;
/// The stalled stream's window: a few records' worth, far below what is published.
const SMALL_WINDOW: u32 = 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_a_full_window_waits_and_its_neighbours_on_the_connection_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let args = e.args();
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &args);
    // One connection: every stream gets SMALL_WINDOW, the connection 4 MiB.
    let mut client = raw_h2::connect(bridge.grpc, SMALL_WINDOW, 4 << 20).await;
    let mut stalled = raw_h2::subscribe(&mut client, bridge.grpc, 0).await;
    let mut reader = raw_h2::subscribe(&mut client, bridge.grpc, 0).await;
    for i in 0..RECORDS {
        e.publish(layout(i), vec![store(i as u64 + 1, 1, None)], 0);
    }

    // The reader gives its window back as it reads, and gets everything.
    let (_, bytes) = read_after(&mut reader, Vec::new(), RECORDS).await;
    let got = batches(&bytes);
    assert_contiguous(&got);
    let sent = stored_hashes(&got);
    assert_eq!(sent.len(), RECORDS, "one block per record");

    // The stalled stream, sharing the connection, was sent no more than its window: the
    // frames that came before the reader's last ones are all there is.
    let held = arrived(&mut stalled);
    assert!(
        !held.is_empty() && held.len() <= SMALL_WINDOW as usize,
        "{} bytes arrived on a stream with a {SMALL_WINDOW}-byte window",
        held.len()
    );
    assert!(batches(&held).len() < RECORDS);

    // Its window opened (capacity given back as it reads): the rest comes, in order.
    stalled.flow_control().release_capacity(held.len()).unwrap();
    let (_, bytes) = read_after(&mut stalled, held, RECORDS).await;
    let got = batches(&bytes);
    assert_contiguous(&got);
    assert_eq!(stored_hashes(&got), sent);
    bridge.stop();
}
