//! The release gateway binary as an operator runs it: in mock mode on an owned `SQLite` file,
//! logging at `info` to a file (each request's access line, refused ones included). Paid calls,
//! then a flood of requests it refuses, at concurrency 16 and 64, `LOADTEST_ROUNDS` times.
//! `LOADTEST_GATEWAY_BIN` names another binary (an older build, say, to compare the two
//! alternated).

use crate::common::{free_address, listening};
use crate::drive::{Figures, Load, drive_load, ms};
use crate::targets::Target;

/// Runs this part; prints each round and the medians.
pub async fn run(requests: u64, rounds: usize) {
    let binary = std::env::var_os("LOADTEST_GATEWAY_BIN").map_or_else(
        || std::env::current_exe().unwrap().with_file_name("gateway"),
        std::path::PathBuf::from,
    );
    assert!(binary.exists(), "{} is not built", binary.display());
    let dir = tempfile::tempdir().unwrap();
    let listen = free_address();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("logged.db").display()
    );
    let log = dir.path().join("gateway.log");
    let env = |command: &mut std::process::Command| {
        command
            .env("DATABASE_URL", &url)
            .env("GATEWAY_LISTEN", &listen)
            .env("MOCK_UPSTREAM", "1")
            .env_remove("RUST_LOG")
            .env_remove("GATEWAY_LOG_FORMAT");
    };
    let mut create = std::process::Command::new(&binary);
    create.args(["keys", "create", "--subscription", "1000000000"]);
    env(&mut create);
    let key = crate::targets::created_key(create);
    let mut serve = std::process::Command::new(&binary);
    serve
        .arg("serve")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    env(&mut serve);
    let mut child = serve.spawn().unwrap();
    listening(&listen).await;
    let target = Target {
        name: "binary, logging",
        base: format!("http://{listen}"),
        key: Some(key),
        store: None,
    };
    println!(
        "{}: logged to a file, {requests} requests per run",
        binary.display()
    );
    println!(
        "{:<10} {:>4} {:>10} {:>9} {:>9}",
        "load", "c", "req/s", "p50 ms", "p99 ms"
    );
    for concurrency in [16, 64] {
        let mut figures: Vec<(Load, Vec<Figures>)> =
            vec![(Load::Calls, Vec::new()), (Load::Refusals, Vec::new())];
        for _ in 0..rounds {
            for (load, runs) in &mut figures {
                drive_load(&target, concurrency, 300, *load).await; // warm-up
                let measured = drive_load(&target, concurrency, requests, *load).await;
                assert_eq!(measured.ok, requests, "not every answer was as expected");
                print_row(*load, concurrency, &measured);
                runs.push(measured);
            }
        }
        if rounds > 1 {
            for (load, runs) in &figures {
                let median = |pick: fn(&Figures) -> f64| crate::drive::median(runs, pick);
                println!(
                    "{:<10} {:>4} {:>10.0} {:>9.3} {:>9.3}  median of {rounds}",
                    name(*load),
                    concurrency,
                    median(|f| f.rps),
                    median(|f| ms(f.p50)),
                    median(|f| ms(f.p99)),
                );
            }
        }
    }
    child.kill().ok();
    child.wait().ok();
    let lines = std::fs::read_to_string(&log).map_or(0, |log| log.lines().count());
    println!("the binary wrote {lines} log lines");
}

fn name(load: Load) -> &'static str {
    match load {
        Load::Calls => "calls",
        Load::Responses => "responses",
        Load::Messages => "messages",
        Load::ChatToMessages => "chat to messages",
        Load::Metered => "metered",
        Load::Costed => "costed",
        Load::Refusals => "refusals",
    }
}

fn print_row(load: Load, concurrency: usize, figures: &Figures) {
    println!(
        "{:<10} {:>4} {:>10.0} {:>9.3} {:>9.3}",
        name(load),
        concurrency,
        figures.rps,
        ms(figures.p50),
        ms(figures.p99),
    );
}
