//! A fake LLM provider for tests: a small HTTP/1.1 server over raw TCP, so that it can do what a
//! broken provider does (reset the connection, answer garbage) as well as what a good one does
//! (keep-alive, byte-exact replies). It records every request it receives.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the provider does with one request.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Answer with this status, extra headers and body.
    Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
    /// Wait, then do the inner thing.
    Delay(Duration, Box<Fault>),
    /// Reset the connection (RST) without answering.
    Reset,
    /// Answer bytes that are not HTTP, then close.
    Garbage,
    /// One of these, picked at random each time.
    OneOf(Vec<Fault>),
    /// A streamed answer (chunked transfer encoding): each chunk after its delay, then `end`.
    Stream {
        status: u16,
        content_type: String,
        chunks: Vec<(Duration, Vec<u8>)>,
        end: StreamEnd,
    },
}

/// How a streamed answer ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// The last chunk, as a good provider ends.
    Finish,
    /// The connection is reset mid-stream.
    Cut,
    /// Nothing more is sent; the connection stays open until the client closes it.
    Hang,
}

impl Fault {
    /// A JSON reply with this status.
    pub fn json(status: u16, body: &str) -> Fault {
        Fault::Reply {
            status,
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    /// Adds a response header.
    pub fn with_header(mut self, name: &str, value: &str) -> Fault {
        if let Fault::Reply { headers, .. } = &mut self {
            headers.push((name.to_owned(), value.to_owned()));
        }
        self
    }

    /// A 200 event stream of these chunks, sent at once, ending normally.
    pub fn sse<C: AsRef<[u8]>>(chunks: impl IntoIterator<Item = C>) -> Fault {
        Fault::Stream {
            status: 200,
            content_type: "text/event-stream".into(),
            chunks: chunks
                .into_iter()
                .map(|chunk| (Duration::ZERO, chunk.as_ref().to_vec()))
                .collect(),
            end: StreamEnd::Finish,
        }
    }

    /// The same stream with each chunk `gap` after the one before.
    pub fn spaced(mut self, gap: Duration) -> Fault {
        if let Fault::Stream { chunks, .. } = &mut self {
            for (delay, _) in chunks.iter_mut() {
                *delay = gap;
            }
        }
        self
    }

    /// The same stream ending as `end` says.
    pub fn ending(mut self, how: StreamEnd) -> Fault {
        if let Fault::Stream { end, .. } = &mut self {
            *end = how;
        }
        self
    }

    /// The same stream with another content type.
    pub fn content_type(mut self, value: &str) -> Fault {
        if let Fault::Stream { content_type, .. } = &mut self {
            *content_type = value.to_owned();
        }
        self
    }

    /// Waits `delay` before doing this.
    pub fn after(self, delay: Duration) -> Fault {
        Fault::Delay(delay, Box::new(self))
    }
}

/// One request as received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The request method.
    pub method: String,
    /// The request target: a path, or an absolute URL when the provider acts as a proxy.
    pub target: String,
    /// Headers with lowercase names, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Seen {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct State {
    seen: Mutex<Vec<Seen>>,
    script: Mutex<VecDeque<Fault>>,
    /// Faults for requests carrying a given `x-request-id`, used once each.
    by_request_id: Mutex<std::collections::HashMap<String, Fault>>,
    fallback: Mutex<Option<Fault>>,
    connections: AtomicUsize,
    /// Streams whose client closed the connection before the stream was finished.
    hung_up: AtomicUsize,
    hang_up: tokio::sync::Notify,
}

/// A running fake provider.
#[derive(Clone)]
pub struct FakeProvider {
    /// `http://127.0.0.1:PORT`
    pub base: String,
    state: Arc<State>,
}

impl FakeProvider {
    pub async fn start() -> FakeProvider {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State::default());
        let accepting = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                accepting.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, accepting.clone()));
            }
        });
        FakeProvider { base, state }
    }

    /// Does `fault` with the next request that has no earlier scripted fault.
    pub fn then(&self, fault: Fault) -> &Self {
        self.state.script.lock().unwrap().push_back(fault);
        self
    }

    /// Does `fault` with the request whose `x-request-id` is `id` (a header the gateway passes
    /// on), whatever order requests arrive in.
    pub fn for_request_id(&self, id: &str, fault: Fault) -> &Self {
        self.state
            .by_request_id
            .lock()
            .unwrap()
            .insert(id.to_owned(), fault);
        self
    }

    /// Does `fault` whenever nothing is scripted.
    pub fn always(&self, fault: Fault) -> &Self {
        *self.state.fallback.lock().unwrap() = Some(fault);
        self
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    pub fn requests(&self) -> usize {
        self.state.seen.lock().unwrap().len()
    }

    pub fn last(&self) -> Seen {
        self.seen().pop().expect("the provider was called")
    }

    /// Streams the gateway abandoned (closed the connection) before they finished.
    pub fn hung_up(&self) -> usize {
        self.state.hung_up.load(Ordering::SeqCst)
    }

    /// Waits until `count` streams have been abandoned by the gateway, at most `within`.
    pub async fn wait_hung_up(&self, count: usize, within: Duration) -> bool {
        tokio::time::timeout(within, async {
            while self.hung_up() < count {
                let notified = self.state.hang_up.notified();
                if self.hung_up() >= count {
                    break;
                }
                notified.await;
            }
        })
        .await
        .is_ok()
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }
}

fn next_fault(state: &State, seen: &Seen) -> Fault {
    let routed = seen
        .header("x-request-id")
        .and_then(|id| state.by_request_id.lock().unwrap().remove(id));
    if let Some(fault) = routed {
        return fault;
    }
    let scripted = state.script.lock().unwrap().pop_front();
    scripted
        .or_else(|| state.fallback.lock().unwrap().clone())
        .unwrap_or_else(|| Fault::json(500, r#"{"error":{"message":"nothing scripted"}}"#))
}

async fn serve(mut stream: TcpStream, state: Arc<State>) {
    let mut buffer: Vec<u8> = Vec::new();
    loop {
        let Some((seen, consumed)) = read_request(&mut stream, &mut buffer).await else {
            return;
        };
        buffer.drain(..consumed);
        let mut fault = next_fault(&state, &seen);
        state.seen.lock().unwrap().push(seen);
        loop {
            match fault {
                Fault::OneOf(choices) => {
                    fault = choices[fastrand::usize(..choices.len())].clone();
                }
                Fault::Delay(delay, inner) => {
                    tokio::time::sleep(delay).await;
                    fault = *inner;
                }
                Fault::Reply {
                    status,
                    headers,
                    body,
                } => {
                    let mut head = format!(
                        "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
                        reason(status),
                        body.len()
                    );
                    for (name, value) in headers {
                        head.push_str(&format!("{name}: {value}\r\n"));
                    }
                    head.push_str("\r\n");
                    if stream.write_all(head.as_bytes()).await.is_err()
                        || stream.write_all(&body).await.is_err()
                    {
                        return;
                    }
                    break;
                }
                Fault::Reset => {
                    let _ = stream.set_zero_linger();
                    return;
                }
                Fault::Stream {
                    status,
                    content_type,
                    chunks,
                    end,
                } => match send_stream(&mut stream, status, &content_type, chunks, end).await {
                    Streamed::Finished => break,
                    Streamed::Closed => return,
                    Streamed::HungUp => {
                        state.hung_up.fetch_add(1, Ordering::SeqCst);
                        state.hang_up.notify_waiters();
                        return;
                    }
                },
                Fault::Garbage => {
                    let _ = stream.write_all(b"THIS IS NOT HTTP AT ALL\r\n\r\n").await;
                    let _ = stream.shutdown().await;
                    return;
                }
            }
        }
    }
}

/// How sending a stream went.
enum Streamed {
    /// Sent to the end; the connection may serve the next request.
    Finished,
    /// The provider cut it, as scripted.
    Closed,
    /// The client closed the connection first.
    HungUp,
}

async fn send_stream(
    stream: &mut TcpStream,
    status: u16,
    content_type: &str,
    chunks: Vec<(Duration, Vec<u8>)>,
    end: StreamEnd,
) -> Streamed {
    let head = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n",
        reason(status)
    );
    if stream.write_all(head.as_bytes()).await.is_err() {
        return Streamed::HungUp;
    }
    for (delay, chunk) in chunks {
        if !delay.is_zero() && closed_within(stream, delay).await {
            return Streamed::HungUp;
        }
        let mut framed = format!("{:x}\r\n", chunk.len()).into_bytes();
        framed.extend_from_slice(&chunk);
        framed.extend_from_slice(b"\r\n");
        if stream.write_all(&framed).await.is_err() {
            return Streamed::HungUp;
        }
    }
    match end {
        StreamEnd::Finish => {
            if stream.write_all(b"0\r\n\r\n").await.is_err() {
                return Streamed::HungUp;
            }
            Streamed::Finished
        }
        StreamEnd::Cut => {
            // A reset discards what the peer has not read yet: give it time to read what was
            // sent, as a connection lost in the network would have.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = stream.set_zero_linger();
            Streamed::Closed
        }
        StreamEnd::Hang => {
            // Until the client closes (bounded, so a test that forgets cannot hang forever).
            if closed_within(stream, Duration::from_secs(60)).await {
                Streamed::HungUp
            } else {
                Streamed::Closed
            }
        }
    }
}

/// Waits `wait`; `true` if the client closed the connection meanwhile.
async fn closed_within(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut byte = [0u8; 1];
    tokio::select! {
        () = tokio::time::sleep(wait) => false,
        read = stream.read(&mut byte) => matches!(read, Ok(0) | Err(_)),
    }
}

fn reason(status: u16) -> &'static str {
    http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Status")
}

/// Reads one request (head and `content-length` body); `None` when the connection ends.
async fn read_request(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<(Seen, usize)> {
    let mut chunk = [0u8; 64 * 1024];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut request = httparse::Request::new(&mut headers);
        if let Ok(httparse::Status::Complete(head_len)) = request.parse(buffer) {
            let target = request.path.unwrap_or_default().to_owned();
            let method = request.method.unwrap_or_default().to_owned();
            let headers: Vec<(String, String)> = request
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_ascii_lowercase(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect();
            let length: usize = headers
                .iter()
                .find(|(n, _)| n == "content-length")
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(0);
            while buffer.len() < head_len + length {
                let read = stream.read(&mut chunk).await.ok()?;
                if read == 0 {
                    return None;
                }
                buffer.extend_from_slice(&chunk[..read]);
            }
            let body = buffer[head_len..head_len + length].to_vec();
            return Some((
                Seen {
                    method,
                    target,
                    headers,
                    body,
                },
                head_len + length,
            ));
        }
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
}

impl std::fmt::Debug for FakeProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeProvider")
            .field("base", &self.base)
            .finish()
    }
}
