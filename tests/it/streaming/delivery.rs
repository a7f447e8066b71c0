//! What a stream bills when its client does not take what it is sent: on HTTP/2, only content
//! the flow-control window let through; on HTTP/1.1, only content the socket accepted; and a
//! client that takes nothing ends its call by the stream's deadline.

use std::net::SocketAddr;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};

use super::*;

const DONE: &str = "data: [DONE]\n\n";

/// An HTTP/2 connection to `base` whose streams may receive `window` bytes each until the
/// client reads and releases them.
async fn h2_connection(
    base: &str,
    window: u32,
) -> (h2::client::SendRequest<Bytes>, tokio::task::JoinHandle<()>) {
    let address = base.trim_start_matches("http://");
    let tcp = TcpStream::connect(address).await.unwrap();
    let (client, connection) = h2::client::Builder::new()
        .initial_window_size(window)
        .handshake(tcp)
        .await
        .unwrap();
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    (client, driver)
}

/// Opens a chat stream on `client` and waits for its head.
async fn h2_chat_stream(
    client: &mut h2::client::SendRequest<Bytes>,
    base: &str,
    key: &str,
) -> h2::RecvStream {
    let request = http::Request::post(format!("{base}{CHAT}"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(())
        .unwrap();
    let mut ready = client.clone().ready().await.unwrap();
    let (response, mut body) = ready.send_request(request, false).unwrap();
    body.send_data(Bytes::from(chat_stream_body(CHAT_MODEL).to_string()), true)
        .unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    response.into_body()
}

/// Reads `stream` to its end, releasing its window as it goes.
async fn h2_read_all(mut stream: h2::RecvStream) -> Vec<u8> {
    let mut received = Vec::new();
    while let Some(data) = stream.data().await {
        let data = data.unwrap();
        let _ = stream.flow_control().release_capacity(data.len());
        received.extend_from_slice(&data);
    }
    received
}

/// Waits until `key` has `count` calls and none is pending, at most `within`; returns them.
async fn all_finished(db: &TestDb, key: &str, count: usize, within: Duration) -> Vec<CallRecord> {
    let started = Instant::now();
    loop {
        let calls = db.calls(key).await;
        if calls.len() == count && calls.iter().all(|call| call.status != CallStatus::Pending) {
            return calls;
        }
        assert!(started.elapsed() < within, "still pending: {calls:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn http2_streams_whose_window_stays_closed_are_refunded_when_the_client_leaves() {
    const STREAMS: usize = 10;
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &[&provider], "").await;
    let key = db.funded_key(STREAMS as i64 * CHAT_PRICE, 0).await;
    // Content first, so the first frame the server takes holds content, then the end.
    provider.always(Fault::sse([CHAT_DELTA, CHAT_DELTA, DONE]));
    let (mut client, driver) = h2_connection(&gateway.base, 0).await;
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        streams.push(h2_chat_stream(&mut client, &gateway.base, &key).await);
    }
    // Every provider answered whole; not a byte of data could reach the client.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(provider.requests(), STREAMS);
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), STREAMS);
    assert!(
        calls.iter().all(|call| call.status == CallStatus::Pending),
        "billed before the client received anything: {calls:?}"
    );
    drop(streams);
    drop(client);
    driver.abort();
    for call in all_finished(&db, &key, STREAMS, Duration::from_secs(5)).await {
        assert_eq!(call.status, CallStatus::Refunded, "{call:?}");
        assert_eq!(
            call.upstream_error.as_deref(),
            Some(CLIENT_LEFT_BEFORE_CONTENT)
        );
    }
    assert_eq!(
        db.balance(&key).await,
        balance(STREAMS as i64 * CHAT_PRICE, 0)
    );
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn an_http2_client_that_reads_its_stream_is_billed_once_it_has_it_all() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &[&provider], "").await;
    let key = db.funded_key(CHAT_PRICE, 0).await;
    let events = [CHAT_ROLE, CHAT_DELTA, CHAT_DELTA, DONE];
    provider.then(Fault::sse(events));
    let (mut client, _driver) = h2_connection(&gateway.base, 65_535).await;
    let stream = h2_chat_stream(&mut client, &gateway.base, &key).await;
    assert_eq!(h2_read_all(stream).await, events.concat().as_bytes());
    // The settle is written before the client's stream ends.
    let call = db.calls(&key).await.remove(0);
    assert_eq!(call.status, CallStatus::Ok);
    assert_eq!(db.balance(&key).await, balance(0, 0));
}

#[tokio::test]
async fn an_http2_client_that_leaves_after_content_went_through_is_billed() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &[&provider], "").await;
    let key = db.funded_key(CHAT_PRICE, 0).await;
    // Two content events apart, then the provider goes quiet: the first went through once the
    // server asked for the second.
    provider.then(
        Fault::sse([CHAT_DELTA, CHAT_DELTA])
            .spaced(Duration::from_millis(200))
            .ending(StreamEnd::Hang),
    );
    let (mut client, driver) = h2_connection(&gateway.base, 65_535).await;
    let mut stream = h2_chat_stream(&mut client, &gateway.base, &key).await;
    let mut received = Vec::new();
    while received.len() < 2 * CHAT_DELTA.len() {
        received.extend_from_slice(&stream.data().await.unwrap().unwrap());
    }
    drop(stream);
    drop(client);
    driver.abort();
    let calls = all_finished(&db, &key, 1, Duration::from_secs(5)).await;
    assert_eq!(calls[0].status, CallStatus::Ok, "{calls:?}");
    assert_eq!(db.balance(&key).await, balance(0, 0));
}

#[tokio::test]
async fn a_stream_whose_client_takes_nothing_ends_by_its_deadline_with_the_connection_open() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &[&provider], "stream_deadline_secs = 2").await;
    let key = db.funded_key(CHAT_PRICE, 0).await;
    provider.then(Fault::sse([CHAT_DELTA, DONE]));
    let (mut client, _driver) = h2_connection(&gateway.base, 0).await;
    let started = Instant::now();
    let _stream = h2_chat_stream(&mut client, &gateway.base, &key).await;
    let calls = all_finished(&db, &key, 1, Duration::from_secs(10)).await;
    let ended_after = started.elapsed();
    assert!(ended_after >= Duration::from_secs(2), "{ended_after:?}");
    assert_eq!(calls[0].status, CallStatus::Refunded);
    assert_eq!(
        calls[0].upstream_error.as_deref(),
        Some(CLIENT_LEFT_BEFORE_CONTENT)
    );
    assert_eq!(db.balance(&key).await, balance(CHAT_PRICE, 0));
    db.assert_audit_holds().await;
}

/// A gateway at the fake `provider` whose sockets hold only a few KiB unsent (the listener's
/// send buffer, which the sockets it accepts inherit).
async fn gateway_with_small_socket_buffers(
    db: &TestDb,
    provider: &FakeProvider,
) -> (Gateway, SocketAddr) {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_send_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(64).unwrap();
    let address = listener.local_addr().unwrap();
    let catalogue = provider_catalogue(&[provider], "");
    let upstream = model_gateway::upstream::HttpUpstream::with_keys(&catalogue, |_| {
        Some("sk-provider".into())
    })
    .unwrap();
    let router = gateway_router(
        db,
        catalogue,
        Upstream::Http(upstream),
        DEFAULT_MAX_BODY_BYTES,
    );
    (serve_router_on(listener, router), address)
}

/// An HTTP/1.1 client that sends a chat stream's request and never reads a byte.
async fn never_reading_client(address: SocketAddr, key: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(address).await.unwrap();
    let body = chat_stream_body(CHAT_MODEL).to_string();
    let request = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

#[tokio::test]
async fn http1_content_the_socket_never_accepted_is_not_billed_and_content_it_did_is() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let (_gateway, address) = gateway_with_small_socket_buffers(&db, &provider).await;

    // 128 KiB without content fill the sockets; the content and the end wait in the server's
    // write buffer behind them.
    let key = db.funded_key(CHAT_PRICE, 0).await;
    let padding = format!(
        "data: {{\"choices\":[],\"padding\":\"{}\"}}\n\n",
        "x".repeat(128 * 1024)
    );
    provider.then(Fault::sse([padding.as_str(), CHAT_DELTA, DONE]));
    let client = never_reading_client(address, &key).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(provider.requests(), 1);
    let call = db.calls(&key).await.remove(0);
    assert_eq!(
        call.status,
        CallStatus::Pending,
        "billed for content still in the server's buffer"
    );
    drop(client);
    let calls = all_finished(&db, &key, 1, Duration::from_secs(5)).await;
    assert_eq!(calls[0].status, CallStatus::Refunded);
    assert_eq!(
        calls[0].upstream_error.as_deref(),
        Some(CLIENT_LEFT_BEFORE_CONTENT)
    );
    assert_eq!(db.balance(&key).await, balance(CHAT_PRICE, 0));

    // A short stream fits in the sockets: accepted, so billed, though the client reads nothing.
    let key = db.funded_key(CHAT_PRICE, 0).await;
    provider.then(Fault::sse([CHAT_DELTA, DONE]));
    let _client = never_reading_client(address, &key).await;
    let calls = all_finished(&db, &key, 1, Duration::from_secs(5)).await;
    assert_eq!(calls[0].status, CallStatus::Ok);
    assert_eq!(db.balance(&key).await, balance(0, 0));
    db.assert_audit_holds().await;
}
