//! Talking to the engine's front end: plain HTTP requests to its OpenAI API, and the standard
//! gRPC health check of its gRPC mode.

use super::*;

/// The standard gRPC health check (`grpc.health.v1.Health/Check`, service "") on
/// 127.0.0.1:`port`: `Ok(Ok(()))` once SERVING, `Err` (why not yet) before.
pub(super) async fn grpc_serving(port: u16) -> Result<Result<(), String>, String> {
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient};
    let call = async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let r = HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map_err(|s| format!("{s:?}"))?;
        match r.into_inner().status() {
            ServingStatus::Serving => Ok(Ok(())),
            other => Err(format!("{other:?}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
}

/// A minimal HTTP/1.1 exchange on loopback: (status, body).
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| e.to_string())?;
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, rest) = out
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP response: {out:?}"))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status: {head:?}"))?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}
