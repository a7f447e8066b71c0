//! A TCP proxy between a gateway and its database that can refuse traffic (every connection
//! closed, new ones dropped) or go silent (connections stay open, nothing passes either way, as
//! when a network drops packets), and then open again.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Passage {
    Open,
    /// Connections are closed and new ones dropped: the database refuses.
    Refused,
    /// Nothing passes, nothing is closed: the database is silent.
    Silent,
}

pub struct DbProxy {
    /// `host:port` to give the gateway instead of the database's.
    pub address: String,
    passage: Arc<watch::Sender<Passage>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl Drop for DbProxy {
    fn drop(&mut self) {
        self.passage.send_replace(Passage::Refused);
        self.accepting.abort();
    }
}

impl DbProxy {
    /// A proxy to `server` (`host:port`), open.
    pub async fn start(server: String) -> DbProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let passage = Arc::new(watch::channel(Passage::Open).0);
        let accepting = {
            let passage = passage.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    if *passage.borrow() == Passage::Refused {
                        continue;
                    }
                    tokio::spawn(carry(client, server.clone(), passage.subscribe()));
                }
            })
        };
        DbProxy {
            address,
            passage,
            accepting,
        }
    }

    pub fn set(&self, passage: Passage) {
        self.passage.send_replace(passage);
    }

    /// `url` (a database URL naming `server`) through this proxy.
    pub fn url(&self, url: &str, server: &str) -> String {
        url.replace(server, &self.address)
    }
}

/// `host:port` of the server a database URL names.
pub fn server_of(url: &str) -> String {
    let after_at = url.split('@').nth(1).unwrap_or(url);
    after_at.split('/').next().unwrap().to_owned()
}

/// Waits until traffic may pass; `false` if the proxy refuses (the connection is to close).
async fn passable(passage: &mut watch::Receiver<Passage>) -> bool {
    match passage.wait_for(|now| *now != Passage::Silent).await {
        Ok(now) => *now == Passage::Open,
        Err(_) => false,
    }
}

async fn carry(client: TcpStream, server: String, mut passage: watch::Receiver<Passage>) {
    if !passable(&mut passage).await {
        return;
    }
    let Ok(upstream) = TcpStream::connect(&server).await else {
        return;
    };
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = upstream.into_split();
    tokio::select! {
        () = pump(client_read, server_write, passage.clone()) => {}
        () = pump(server_read, client_write, passage) => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut passage: watch::Receiver<Passage>,
) {
    let mut buffer = vec![0_u8; 16 * 1024];
    loop {
        if !passable(&mut passage).await {
            return;
        }
        let read = tokio::select! {
            read = from.read(&mut buffer) => read,
            _ = passage.changed() => continue,
        };
        let Ok(n @ 1..) = read else {
            return;
        };
        // What was read before a silence is held until it ends.
        if !passable(&mut passage).await || to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
