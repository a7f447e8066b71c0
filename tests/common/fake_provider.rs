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

    /// Waits `delay` before doing this.
    pub fn after(self, delay: Duration) -> Fault {
        Fault::Delay(delay, Box::new(self))
    }
}

/// One request as received.
#[derive(Debug, Clone)]
pub struct Seen {
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
    fallback: Mutex<Option<Fault>>,
    connections: AtomicUsize,
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

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }
}

fn next_fault(state: &State) -> Fault {
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
        state.seen.lock().unwrap().push(seen);
        let mut fault = next_fault(&state);
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
                Fault::Garbage => {
                    let _ = stream.write_all(b"THIS IS NOT HTTP AT ALL\r\n\r\n").await;
                    let _ = stream.shutdown().await;
                    return;
                }
            }
        }
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
