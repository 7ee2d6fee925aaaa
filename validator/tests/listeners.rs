//! The listeners' connection bounds, over real sockets on loopback: a client
//! that sends nothing, half a request head or never reads its answer is
//! closed; a full API listener turns new connections away and leaves the
//! admin listener answering.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use staleguard_validator::api::{self, ApiConfig, ConnectionLimits};
use staleguard_validator::synth;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Serves a small index with these connection bounds on the API listener;
/// returns the API's and the admin listener's addresses.
async fn validator(connections: ConnectionLimits) -> (SocketAddr, SocketAddr) {
    validator_of(synth::indexed(synth::cluster(3, 4)), connections).await
}

async fn validator_of(
    index: staleguard_validator::live::SharedIndex,
    connections: ConnectionLimits,
) -> (SocketAddr, SocketAddr) {
    let config = ApiConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        connections,
        ..ApiConfig::default()
    };
    api::spawn(index, &config).await.unwrap()
}

/// Connects to `to` from the loopback address `from`.
async fn connect_from(from: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

/// How long until the server closes `stream` (reads give EOF or a reset),
/// `None` if it is still open after `within`. Whatever the server sends
/// before closing is read and dropped.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = vec![0u8; 64 * 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// `GET path` on a new connection; the status line of the answer.
async fn get(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
        .await
        .expect("no answer within 5 s")
        .unwrap();
    String::from_utf8_lossy(&answer)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

/// The value of an unlabelled-prefix series line `name{labels} value` of the
/// admin listener's `/metrics`, 0 when absent.
async fn metric(admin: SocketAddr, series: &str) -> f64 {
    let mut stream = TcpStream::connect(admin).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    answer
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn header_read_timeout_closes_an_idle_connection_and_a_half_sent_head() {
    let timeout = Duration::from_millis(400);
    let (public, admin) = validator(ConnectionLimits {
        header_read_timeout: timeout,
        ..ConnectionLimits::API
    })
    .await;
    let opened = Instant::now();
    let mut idle = TcpStream::connect(public).await.unwrap();
    let mut half = TcpStream::connect(public).await.unwrap();
    half.write_all(b"GET /v1/snapshot HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        .await
        .unwrap();
    // Before the fix, neither closed within 45 s; allow a loaded machine 10x.
    for (what, stream) in [("idle", &mut idle), ("half-sent head", &mut half)] {
        closed_within(stream, timeout * 10)
            .await
            .unwrap_or_else(|| panic!("the {what} connection is still open"));
        let closed = opened.elapsed();
        assert!(closed >= timeout, "{what} closed after {closed:?}");
    }
    let timed_out = metric(
        admin,
        r#"staleguard_validator_connections_timed_out_total{listener="api",reason="header_read"}"#,
    )
    .await;
    assert_eq!(timed_out, 2.0);
}

#[tokio::test]
async fn header_read_timeout_also_ends_a_kept_alive_connection_between_requests() {
    let timeout = Duration::from_millis(400);
    let (public, _) = validator(ConnectionLimits {
        header_read_timeout: timeout,
        ..ConnectionLimits::API
    })
    .await;
    let mut stream = TcpStream::connect(public).await.unwrap();
    stream
        .write_all(b"GET /v1/ips/10.9.9.9 HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = stream.read(&mut buf).await.unwrap();
    assert!(
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 404"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    // The connection stays open for another request, but not for ever.
    assert!(closed_within(&mut stream, timeout * 10).await.is_some());
}

#[tokio::test]
async fn idle_timeout_closes_a_connection_whose_client_stops_reading_its_answer() {
    // An answer far larger than the socket buffers, so the server's write
    // stalls once the client stops reading.
    let index = synth::indexed(synth::cluster(50, 400));
    let idle = Duration::from_millis(500);
    let (public, admin) = validator_of(
        index,
        ConnectionLimits {
            idle_timeout: idle,
            ..ConnectionLimits::API
        },
    )
    .await;
    let mut stream = TcpStream::connect(public).await.unwrap();
    stream
        .write_all(b"GET /v1/snapshot HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 1024];
    stream.read_exact(&mut buf).await.unwrap();
    // Not reading any more: the server's writes stall, then it gives up.
    let series =
        r#"staleguard_validator_connections_timed_out_total{listener="api",reason="idle"}"#;
    let deadline = Instant::now() + idle * 20;
    while metric(admin, series).await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the stalled answer's connection was not closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn healthz_answers_while_the_api_max_connections_cap_is_full() {
    let (public, admin) = validator(ConnectionLimits {
        max_connections: 4,
        header_read_timeout: Duration::from_secs(30),
        ..ConnectionLimits::API
    })
    .await;
    // Four clients, each from its own address, hold every API connection.
    let mut held = Vec::new();
    for last in 1..=4 {
        held.push(connect_from([127, 0, 0, last], public).await);
    }
    // A fifth is closed as soon as it is accepted.
    let mut fifth = connect_from([127, 0, 0, 5], public).await;
    assert!(
        closed_within(&mut fifth, Duration::from_secs(5))
            .await
            .is_some(),
        "a connection over --max-connections stayed open"
    );
    let started = Instant::now();
    assert_eq!(get(admin, "/healthz").await, "HTTP/1.1 200 OK");
    assert!(started.elapsed() < Duration::from_secs(2));
    let refused = metric(
        admin,
        r#"staleguard_validator_connections_refused_total{listener="api",reason="max_connections"}"#,
    )
    .await;
    assert_eq!(refused, 1.0);
    // One client leaving makes room again.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    while get(public, "/v1/ips/10.9.9.9").await != "HTTP/1.1 404 Not Found" {
        assert!(Instant::now() < deadline, "no room after a client left");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn max_connections_per_source_turns_away_one_address_and_not_the_others() {
    let (public, admin) = validator(ConnectionLimits {
        max_per_source: 2,
        header_read_timeout: Duration::from_secs(30),
        ..ConnectionLimits::API
    })
    .await;
    let _held = [
        connect_from([127, 0, 0, 7], public).await,
        connect_from([127, 0, 0, 7], public).await,
    ];
    let mut third = connect_from([127, 0, 0, 7], public).await;
    assert!(
        closed_within(&mut third, Duration::from_secs(5))
            .await
            .is_some(),
        "a third connection from one address stayed open"
    );
    // Another address is served.
    assert_eq!(
        get(public, "/v1/ips/10.9.9.9").await,
        "HTTP/1.1 404 Not Found"
    );
    let refused = metric(
        admin,
        r#"staleguard_validator_connections_refused_total{listener="api",reason="max_per_source"}"#,
    )
    .await;
    assert_eq!(refused, 1.0);
}

#[test]
fn the_api_cap_leaves_room_for_the_admin_listener_within_the_file_limit() {
    // `ulimit -n 256`, the probe that made /healthz time out before.
    let fitted = api::fit_api_cap(8192, 128, Some(1024));
    assert_eq!(fitted, 1024 - 128 - api::RESERVED_FILES as usize);
    assert_eq!(api::fit_api_cap(8192, 128, Some(1_048_576)), 8192);
    assert_eq!(api::fit_api_cap(8192, 128, Some(256)), 1, "never zero");
    assert_eq!(api::fit_api_cap(8192, 128, None), 8192);
    let limit = api::raise_file_limit().expect("the file limit is readable");
    assert!(limit >= 256, "{limit}");
}
