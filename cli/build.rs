//! Link options for the released binary only (docs/benchmarks.md, "The binary and the
//! build"): identical code folded once, and relative relocations packed, which together keep
//! the installed `tandem` near 58 MB instead of 63. Both are the linker's work alone: no crate
//! is compiled differently, and a debug build (the tests') links as before.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=TANDEM_PLAIN_LINK");
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    // rust-lld, the toolchain's default linker for this target since Rust 1.90, takes both;
    // elsewhere the platform's linker may not.
    let lld_target = std::env::var("TARGET").is_ok_and(|t| t == "x86_64-unknown-linux-gnu");
    if !release || !lld_target || std::env::var_os("TANDEM_PLAIN_LINK").is_some() {
        return;
    }
    println!("cargo:rustc-link-arg-bins=-Wl,--icf=all");
    // A packed relocation table needs the loader to read it (glibc 2.36): a binary that this
    // machine's glibc could not load is never made.
    if glibc_at_least(2, 36) {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// Whether this machine's glibc is at least `major.minor` (`getconf GNU_LIBC_VERSION`).
fn glibc_at_least(major: u32, minor: u32) -> bool {
    let Ok(out) = Command::new("getconf").arg("GNU_LIBC_VERSION").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(version) = text.trim().strip_prefix("glibc ") else {
        return false;
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    found >= (major, minor)
}
