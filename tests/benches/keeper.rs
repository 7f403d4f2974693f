//! What the keeper costs: listing and packing a 10,000-file workspace through
//! `tandem_executor_kit::archive` (every step beneath a handle, no link followed, each file
//! opened without blocking and checked), against a plain walk in the same process that
//! defends against nothing (`std::fs::read_dir` recursion, `symlink_metadata`, `File::open`
//! by path), and how far the keeper walks a deep and a wide tree.
//!
//! `cargo bench -p tandem-tests --bench keeper`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tandem_executor_kit::archive::{self, ArchiveCaps};
use tandem_executor_kit::keeper;

const FILES: usize = 10_000;
const RUNS: usize = 7;

/// 10,000 files of 100 bytes in 100 directories of 100.
fn workspace(root: &Path) {
    for d in 0..FILES / 100 {
        let dir = root.join(format!("dir{d:03}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..100 {
            std::fs::write(dir.join(format!("file{f:03}.txt")), [b'x'; 100]).unwrap();
        }
    }
}

/// The plain walk: what a listing costs with no defence.
fn plain_list(root: &Path) -> usize {
    let mut stack = vec![PathBuf::from(root)];
    let mut found = Vec::new();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let meta = std::fs::symlink_metadata(entry.path()).unwrap();
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() {
                found.push((entry.path(), meta.len()));
            }
        }
    }
    found.sort();
    found.len()
}

/// The plain tar: the plain walk, each file opened by path and its bytes written.
fn plain_tar(root: &Path) -> usize {
    let mut out = Vec::with_capacity(12 << 20);
    let mut builder = tar::Builder::new(&mut out);
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut names: Vec<_> = std::fs::read_dir(root.join(&rel))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for name in names {
            let path = rel.join(&name);
            let meta = std::fs::symlink_metadata(root.join(&path)).unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                let mut data = Vec::new();
                std::fs::File::open(root.join(&path))
                    .unwrap()
                    .read_to_end(&mut data)
                    .unwrap();
                let mut header = tar::Header::new_gnu();
                header.set_size(data.len() as u64);
                header.set_mode(0o644);
                builder.append_data(&mut header, &path, &data[..]).unwrap();
            }
        }
    }
    builder.finish().unwrap();
    drop(builder);
    out.len()
}

fn median(mut f: impl FnMut() -> usize) -> (Duration, usize) {
    let mut times = Vec::new();
    let mut n = 0;
    for _ in 0..RUNS {
        let start = Instant::now();
        n = f();
        times.push(start.elapsed());
    }
    times.sort();
    (times[RUNS / 2], n)
}

/// Peak resident memory of this process, in MiB (`VmHWM`).
fn peak_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

fn main() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = tmp.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    workspace(&ws);
    let caps = ArchiveCaps {
        max_bytes: u64::MAX,
        max_entries: 100_000,
    };
    let (plain_l, n1) = median(|| plain_list(&ws));
    let (keeper_l, n2) = median(|| archive::list(&ws, 100_000).unwrap().len());
    assert_eq!(n1, n2);
    let (plain_t, _) = median(|| plain_tar(&ws));
    let (keeper_t, n3) = median(|| {
        let mut out = Vec::with_capacity(12 << 20);
        archive::pack(&ws, "", &mut out, caps).unwrap().len()
    });
    assert_eq!(n3, FILES);
    println!("keeper: a {FILES}-file workspace, median of {RUNS} runs");
    println!("| operation | plain walk | keeper | keeper / plain |");
    println!("|---|---|---|---|");
    for (what, plain, kept) in [("list", plain_l, keeper_l), ("tar", plain_t, keeper_t)] {
        println!(
            "| {what} | {:.1} ms | {:.1} ms | {:.2} |",
            plain.as_secs_f64() * 1e3,
            kept.as_secs_f64() * 1e3,
            kept.as_secs_f64() / plain.as_secs_f64()
        );
    }

    // Depth and width walked in bounded memory: a chain 100,000 deep and a directory of
    // 100,000 entries, measured (every entry) and removed by the keeper, then made again and
    // removed by GNU `rm -rf` (fts, which keeps a descriptor or a path per level) as the
    // baseline; peak memory before and after.
    let before = peak_mib();
    let deep = tmp.path().join("deep");
    let wide = tmp.path().join("wide");
    let mut rows = Vec::new();
    for (what, make) in [
        ("100,000 deep", make_deep as fn(&Path)),
        ("100,000 wide", make_wide as fn(&Path)),
    ] {
        let tree = if what.ends_with("deep") { &deep } else { &wide };
        make(tree);
        let start = Instant::now();
        let usage = keeper::usage(tree, 10_000_000).unwrap();
        let measured = start.elapsed();
        assert_eq!(usage.entries, 100_001);
        let start = Instant::now();
        keeper::remove_tree(tree).unwrap();
        let kept = start.elapsed();
        make(tree);
        let start = Instant::now();
        let rm = std::process::Command::new("rm")
            .arg("-rf")
            .arg(tree)
            .status()
            .unwrap();
        let plain = start.elapsed();
        assert!(rm.success() && !tree.exists());
        rows.push((what, measured, kept, plain));
    }
    println!();
    println!("| tree | measured (keeper) | removed: rm -rf | keeper | keeper / rm -rf |");
    println!("|---|---|---|---|---|");
    for (what, measured, kept, plain) in rows {
        println!(
            "| {what} | {:.0} ms | {:.0} ms | {:.0} ms | {:.2} |",
            measured.as_secs_f64() * 1e3,
            plain.as_secs_f64() * 1e3,
            kept.as_secs_f64() * 1e3,
            kept.as_secs_f64() / plain.as_secs_f64()
        );
    }
    println!(
        "peak RSS {before:.0} MiB before the trees, {:.0} MiB after",
        peak_mib()
    );
}

/// A chain of 100,000 directories, each made beneath the last one's descriptor, so no path
/// ever grows past PATH_MAX.
fn make_deep(root: &Path) {
    use std::os::fd::AsRawFd as _;
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::create_dir(root).unwrap();
    let mut dir = std::fs::File::open(root).unwrap();
    for _ in 0..100_000 {
        let here = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
        std::fs::DirBuilder::new()
            .mode(0o755)
            .create(here.join("d"))
            .unwrap();
        dir = std::fs::File::open(here.join("d")).unwrap();
    }
}

/// A directory of 100,000 empty files.
fn make_wide(root: &Path) {
    std::fs::create_dir(root).unwrap();
    for i in 0..100_000 {
        std::fs::File::create(root.join(i.to_string())).unwrap();
    }
}
