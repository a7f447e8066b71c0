//! The release gateway binary's resident memory, idle and with 1000 open connections.

use std::time::Duration;

use crate::common::{free_address, listening, resident_kib};
use crate::targets::BODY;

/// Starts the release gateway binary, opens 1000 keep-alive connections that each made one
/// call, and reads the process's resident memory.
pub async fn resident_memory_with_1000_connections() -> Option<(u64, u64)> {
    let binary = std::env::current_exe().ok()?.with_file_name("gateway");
    if !binary.exists() {
        eprintln!("{} not built; skipping the memory check", binary.display());
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let listen = free_address();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("rss.db").display());
    let env = |command: &mut std::process::Command| {
        command
            .env("DATABASE_URL", &url)
            .env("GATEWAY_LISTEN", &listen)
            .env("MOCK_UPSTREAM", "1")
            .env("RUST_LOG", "warn");
    };
    let mut create = std::process::Command::new(&binary);
    create.args(["keys", "create", "--subscription", "100000"]);
    env(&mut create);
    let key = crate::targets::created_key(create);
    let mut serve = std::process::Command::new(&binary);
    serve.arg("serve").stdout(std::process::Stdio::null());
    env(&mut serve);
    let mut child = serve.spawn().unwrap();
    listening(&listen).await;
    let rss = || resident_kib(child.id());
    let idle = rss();
    let mut connections = Vec::new();
    for _ in 0..1000 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(&listen).await.unwrap();
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
            BODY.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut buffer = [0u8; 2048];
        let read = stream.read(&mut buffer).await.unwrap();
        assert!(buffer[..read].starts_with(b"HTTP/1.1 200"));
        connections.push(stream); // kept open (keep-alive)
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let loaded = rss();
    drop(connections);
    child.kill().ok();
    child.wait().ok();
    Some((idle, loaded))
}
