//! Snapshot and restore time per GiB of workspace, and a second snapshot of a barely changed
//! one, each beside its baseline in the same run: copying the same files with `std::fs::copy`
//! (what a snapshot costs at least) and packing them with the archive kit (what a download
//! of the workspace costs).
//!
//! `cargo bench -p tandem-snapshots --bench snapshots` (`TANDEM_BENCH_GIB`, default 1).
#![allow(clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use tandem_snapshots::{Caps, Source, Store};

fn main() {
    let gib: u64 = std::env::var("TANDEM_BENCH_GIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let root = tempfile::tempdir().expect("a scratch directory");
    let work = root.path().join("work");
    let files = (gib * 1024 / 4) as usize; // 4 MiB each
    make_workspace(&work, files);
    let bytes = files as u64 * (4 << 20);
    let per_gib = |secs: f64| secs / (bytes as f64 / (1u64 << 30) as f64);

    // Baselines: a plain copy, and a tar of it through the archive kit.
    let copy_to = root.path().join("copy");
    let t = Instant::now();
    copy_tree(&work, &copy_to);
    let copy = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let sink = std::fs::File::create(root.path().join("pack.tar")).expect("a tar file");
    tandem_executor_kit::archive::pack(
        &work,
        "",
        std::io::BufWriter::new(sink),
        tandem_executor_kit::archive::ArchiveCaps {
            max_bytes: u64::MAX,
            max_entries: 1_000_000,
        },
    )
    .expect("packed");
    let pack = t.elapsed().as_secs_f64();

    let store = Store::open(
        &root.path().join("store"),
        Caps {
            max_bytes: u64::MAX,
            ..Caps::default()
        },
    )
    .expect("a store");
    let source = || Source {
        kind: "session".into(),
        id: "bench".into(),
        executor: "local".into(),
    };
    let t = Instant::now();
    let first = store
        .take(&work, None, source(), Vec::new(), Vec::new(), None)
        .expect("a snapshot");
    let take = t.elapsed().as_secs_f64();

    // Barely changed: one file of the workspace rewritten.
    std::fs::write(work.join("f00000.bin"), b"changed").expect("a change");
    let t = Instant::now();
    let second = store
        .take(&work, None, source(), Vec::new(), Vec::new(), None)
        .expect("a second snapshot");
    let again = t.elapsed().as_secs_f64();

    let out = root.path().join("restore");
    std::fs::create_dir(&out).expect("a restore directory");
    let t = Instant::now();
    let tar = store.restore_tar(&first.id, &out, None).expect("a restore");
    let checked = t.elapsed().as_secs_f64();
    let placed = root.path().join("placed");
    std::fs::create_dir(&placed).expect("a workspace to place into");
    tandem_executor_kit::archive::unpack_into(
        &placed,
        std::fs::File::open(&tar).expect("the archive"),
        tandem_executor_kit::archive::ArchiveCaps {
            max_bytes: u64::MAX,
            max_entries: 1_000_000,
        },
    )
    .expect("placed");
    let restore = t.elapsed().as_secs_f64();

    println!(
        "workspace: {files} files of 4 MiB, {:.2} GiB, in {}",
        bytes as f64 / (1u64 << 30) as f64,
        root.path().display()
    );
    println!();
    println!("| figure | time | per GiB | against copying the files |");
    println!("|---|---|---|---|");
    println!(
        "| copy every file (`std::fs::copy`), the floor | {copy:.2} s | {:.2} s | 1.00 |",
        per_gib(copy)
    );
    println!(
        "| tar of the workspace (the archive kit) | {pack:.2} s | {:.2} s | {:.2} |",
        per_gib(pack),
        pack / copy
    );
    println!(
        "| snapshot, first (hash and keep every file) | {take:.2} s | {:.2} s | {:.2} |",
        per_gib(take),
        take / copy
    );
    println!(
        "| snapshot, second, one file changed | {again:.2} s, {} bytes added | {:.2} s | {:.2} |",
        second.added_bytes,
        per_gib(again),
        again / copy
    );
    println!(
        "| restore into a new workspace (check every hash, tar, place) | {restore:.2} s | {:.2} s | {:.2} |",
        per_gib(restore),
        restore / copy
    );
    println!(
        "| of which: every hash checked and the archive written | {checked:.2} s | {:.2} s | {:.2} |",
        per_gib(checked),
        checked / copy
    );
}

/// `files` files of 4 MiB each, every one different (a counter in each 4 KiB page).
fn make_workspace(dir: &Path, files: usize) {
    std::fs::create_dir_all(dir).expect("the workspace");
    let mut page = vec![0u8; 4096];
    for i in 0..files {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(dir.join(format!("f{i:05}.bin"))).expect("a file"),
        );
        for p in 0..1024u32 {
            page[..4].copy_from_slice(&(i as u32).to_le_bytes());
            page[4..8].copy_from_slice(&p.to_le_bytes());
            f.write_all(&page).expect("written");
        }
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("the copy");
    for entry in std::fs::read_dir(from).expect("the workspace") {
        let entry = entry.expect("an entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copied");
    }
}
