//! The tests' stand-in Kubernetes API server on its own, for benchmarks that measure the
//! Kubernetes executor through a daemon (python/bench/start.py): prints its URL, serves
//! until its standard input closes, then removes every container it started.

use std::io::{Read as _, Write as _};

#[tokio::main]
async fn main() {
    let cluster = tandem_tests::kubernetes::FakeCluster::deployed().await;
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{}", cluster.url);
    let _ = out.flush();
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        std::io::stdin().read_to_end(&mut sink)
    })
    .await;
    cluster.stop().await;
}
