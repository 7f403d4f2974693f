//! Confining local blocks with the kernel. The fork server's waiter applies the policy built
//! here before it starts a block, so the block and everything it starts inherit it:
//! - files (Landlock): system directories, the interpreters' prefixes and configured extra
//!   paths read-only; the workspace, the session's private tmp and `/dev/null` read-write;
//!   nothing else, the user's home included;
//! - network: a new network namespace (in a new user namespace) with nothing in it, or, where
//!   namespaces are refused, Landlock's TCP rules with no port allowed;
//! - seccomp: no ptrace, `process_vm_*`, bpf, mount, keyring, namespace, module or io_uring
//!   calls, and no new Unix socket (the daemon's socket is reachable by path);
//! - Landlock scopes signals and abstract unix sockets to the block's own domain, and its
//!   ptrace rule keeps the block out of Tandem's `/proc/<pid>/environ` and memory and from
//!   resolving its fds (the kernel still lets anyone list the fd numbers).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// Whether local blocks are confined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Confine {
    /// Confined where the kernel can; unconfined (and said so) where it cannot.
    #[default]
    Auto,
    /// Never confined.
    Off,
    /// Confined, or not run at all.
    Required,
}

impl std::str::FromStr for Confine {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            "required" => Ok(Self::Required),
            other => Err(format!(
                "confine must be auto, off or required, got `{other}`"
            )),
        }
    }
}

/// What the kernel offers for confinement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Support {
    /// The Landlock ABI version; 0 when Landlock is off or absent.
    pub landlock_abi: i64,
    /// Whether this process may make user (and so network) namespaces.
    pub user_namespaces: bool,
    /// Whether seccomp filters can be installed.
    pub seccomp: bool,
}

impl Support {
    /// What this machine's kernel offers (asked once).
    pub fn probe() -> Self {
        static SUPPORT: OnceLock<Support> = OnceLock::new();
        *SUPPORT.get_or_init(|| {
            // SAFETY: landlock_create_ruleset with a null attribute, size 0 and the VERSION
            // flag only returns the ABI version (or an error); it touches no memory.
            #[allow(unsafe_code)]
            let abi = unsafe {
                nix::libc::syscall(
                    nix::libc::SYS_landlock_create_ruleset,
                    std::ptr::null::<u8>(),
                    0usize,
                    1u32,
                )
            };
            let max_userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(0);
            let unprivileged =
                std::fs::read_to_string("/proc/sys/kernel/unprivileged_userns_clone")
                    .map_or(true, |s| s.trim() != "0");
            Self {
                landlock_abi: abi.max(0),
                user_namespaces: max_userns > 0
                    && (unprivileged || nix::unistd::geteuid().is_root()),
                seccomp: std::path::Path::new("/proc/sys/kernel/seccomp").exists()
                    || std::fs::read_to_string("/proc/self/status")
                        .is_ok_and(|s| s.contains("Seccomp:")),
            }
        })
    }

    /// Whether blocks can be confined here: Landlock for files, and a network namespace or
    /// Landlock's TCP rules (ABI 4) for the network.
    pub fn can_confine(&self) -> bool {
        self.landlock_abi >= 1 && self.seccomp && (self.user_namespaces || self.landlock_abi >= 4)
    }

    /// Whether a block can have a PID namespace of its own: root may always make one, anyone
    /// else inside a user namespace of their own.
    pub fn pid_namespaces(&self) -> bool {
        self.user_namespaces || nix::unistd::geteuid().is_root()
    }

    /// One line for `tandem doctor`.
    pub fn describe(&self) -> String {
        format!(
            "Landlock {}, user namespaces {}, seccomp {}",
            if self.landlock_abi > 0 {
                format!("ABI {}", self.landlock_abi)
            } else {
                "absent".to_owned()
            },
            if self.user_namespaces { "yes" } else { "no" },
            if self.seccomp { "yes" } else { "no" },
        )
    }
}

/// What the waiter is told to apply (forkserver.py's `confine`); a Landlock ruleset goes
/// beside the request as a file descriptor.
#[derive(Clone, Debug, serde::Serialize)]
pub(crate) struct Policy {
    /// What each block's Landlock ruleset allows (see [`Policy::ruleset`]).
    #[serde(skip)]
    paths: Arc<Paths>,
    /// Whether the block gets a PID and mount namespace of its own, with a `/proc` that shows
    /// only its own processes (the waiter adds that `/proc` to the block's ruleset): `None`
    /// where the kernel cannot make one, `"try"` (run without where it refuses), `"required"`.
    pub pid_namespace: Option<&'static str>,
    /// Whether blocks may use the network.
    pub network: bool,
    /// Whether the ruleset denies TCP (Landlock ABI 4), for when no network namespace can be
    /// made.
    pub tcp: bool,
    /// The seccomp program, hex of its `sock_filter`s in native byte order.
    pub seccomp: String,
}

/// System paths interpreters read: libraries, the loader's cache, the little of `/etc` that
/// name lookups, time zones, certificates and Debian's Python read.
const SYSTEM_READ: &[&str] = &[
    "/usr",
    "/lib",
    "/lib64",
    "/lib32",
    "/libx32",
    "/bin",
    "/sbin",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/resolv.conf",
    "/etc/gai.conf",
    "/etc/protocols",
    "/etc/services",
    "/etc/mime.types",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/alternatives",
    "/etc/os-release",
    "/etc/debian_version",
    "/proc",
    "/sys/devices/system/cpu",
    "/sys/fs/cgroup",
    "/dev/urandom",
    "/dev/random",
    "/dev/zero",
    "/dev/full",
];

/// What every session's blocks may read: the system's paths, Debian's `/etc/python3.N`,
/// the interpreters' `prefixes` and the configured `extra` paths.
pub(crate) fn readable(prefixes: &[PathBuf], extra: &[PathBuf]) -> Vec<PathBuf> {
    let mut read: Vec<PathBuf> = SYSTEM_READ.iter().map(PathBuf::from).collect();
    if let Ok(entries) = std::fs::read_dir("/etc") {
        read.extend(
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                .map(|e| e.path()),
        );
    }
    read.extend(prefixes.iter().cloned());
    read.extend(extra.iter().cloned());
    read
}

/// The policy for a session: `workspace`, `tmp` and `also_write` (its volumes) writable,
/// `read` ([`readable`]) readable; with `required`, a block that cannot have its own PID
/// namespace does not run.
pub(crate) fn policy(
    workspace: &Path,
    tmp: &Path,
    also_write: &[PathBuf],
    read: &[PathBuf],
    network: bool,
    required: bool,
) -> std::io::Result<Policy> {
    let mut write = vec![
        workspace.to_owned(),
        tmp.to_owned(),
        PathBuf::from("/dev/null"),
    ];
    write.extend(also_write.iter().cloned());
    let support = Support::probe();
    let tcp = !network && support.landlock_abi >= 4;
    let paths = Paths {
        abi: support.landlock_abi,
        read: read.to_vec(),
        write: write.to_vec(),
    };
    // Made once here so that a session that cannot be confined fails at its start.
    drop(ruleset(paths.abi, &paths.read, &paths.write, tcp, None)?);
    Ok(Policy {
        paths: Arc::new(paths),
        pid_namespace: match (support.pid_namespaces(), required) {
            (false, _) => None,
            (true, false) => Some("try"),
            (true, true) => Some("required"),
        },
        network,
        tcp,
        seccomp: seccomp_hex().to_owned(),
    })
}

/// The paths a session's rulesets name.
#[derive(Debug)]
struct Paths {
    abi: i64,
    read: Vec<PathBuf>,
    write: Vec<PathBuf>,
}

impl Policy {
    /// A fresh Landlock ruleset for one block. Each block gets its own because its waiter adds
    /// a rule for the block's own `/proc` (a new procfs each time): on a ruleset shared by the
    /// session, those rules would pile up, one per block, in every later domain.
    pub(crate) fn ruleset(&self, egress: bool, own_network: bool) -> std::io::Result<OwnedFd> {
        ruleset(
            self.paths.abi,
            &self.paths.read,
            &self.paths.write,
            // In its session's network namespace, whose one interface is its loopback, a
            // block may serve and connect there: what it reaches is its own session's.
            self.tcp && !own_network,
            // Behind the proxy the block is in a network namespace of its own whose only
            // listener is the relay: connecting to its port reaches nothing else.
            egress.then_some(tandem_executor::EGRESS_PORT),
        )
    }
}

/// Landlock's filesystem rights that ABI `abi` handles (linux/landlock.h).
fn fs_rights(abi: i64) -> u64 {
    match abi {
        1 => (1 << 13) - 1,
        2 => (1 << 14) - 1,
        3 | 4 => (1 << 15) - 1,
        _ => (1 << 16) - 1,
    }
}

/// Execute, read a file, read a directory.
const READ: u64 = (1 << 0) | (1 << 2) | (1 << 3);
/// The rights a rule on a file (not a directory) may hold.
const FILE: u64 = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15);

#[repr(C)]
struct RulesetAttr {
    fs: u64,
    net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneath {
    allowed: u64,
    parent_fd: i32,
}

/// A Landlock ruleset that allows `read` read-only and `write` read-write and nothing else
/// on files; with `tcp`, no TCP bind or connect; from ABI 6, signals and abstract unix
/// sockets scoped to the domain. Paths that do not exist are skipped.
fn ruleset(
    abi: i64,
    read: &[PathBuf],
    write: &[PathBuf],
    tcp: bool,
    connect: Option<u16>,
) -> std::io::Result<OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let fs = fs_rights(abi);
    let attr = RulesetAttr {
        fs,
        net: if tcp { 3 } else { 0 },
        scoped: 3,
    };
    let size: usize = match abi {
        ..=3 => 8,
        4 | 5 => 16,
        _ => 24,
    };
    // SAFETY: `attr` outlives the call and `size` is at most its size.
    #[allow(unsafe_code)]
    let fd = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_landlock_create_ruleset,
            &raw const attr,
            size,
            0u32,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::other("bad ruleset fd"))?;
    // SAFETY: the kernel just returned this descriptor, which nothing else owns.
    #[allow(unsafe_code)]
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd) };
    for (paths, rights) in [(read, READ), (write, fs)] {
        for path in paths {
            let Ok(target) = nix::fcntl::open(
                path.as_path(),
                nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            ) else {
                continue;
            };
            let mut allowed = rights & fs;
            if !std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
                allowed &= FILE;
            }
            let rule = PathBeneath {
                allowed,
                parent_fd: target.as_raw_fd(),
            };
            // SAFETY: `rule` outlives the call; 1 is LANDLOCK_RULE_PATH_BENEATH.
            #[allow(unsafe_code)]
            let added = unsafe {
                nix::libc::syscall(
                    nix::libc::SYS_landlock_add_rule,
                    ruleset.as_raw_fd(),
                    1u32,
                    &raw const rule,
                    0u32,
                )
            };
            if added < 0 {
                let e = std::io::Error::last_os_error();
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("a Landlock rule for {}: {e}", path.display()),
                ));
            }
        }
    }
    if let Some(port) = connect.filter(|_| tcp) {
        let rule = NetPort {
            allowed: 1 << 1, // LANDLOCK_ACCESS_NET_CONNECT_TCP
            port: u64::from(port),
        };
        // SAFETY: `rule` outlives the call; 2 is LANDLOCK_RULE_NET_PORT.
        #[allow(unsafe_code)]
        let added = unsafe {
            nix::libc::syscall(
                nix::libc::SYS_landlock_add_rule,
                ruleset.as_raw_fd(),
                2u32,
                &raw const rule,
                0u32,
            )
        };
        if added < 0 {
            let e = std::io::Error::last_os_error();
            return Err(std::io::Error::new(
                e.kind(),
                format!("a Landlock rule for TCP port {port}: {e}"),
            ));
        }
    }
    Ok(ruleset)
}

#[repr(C)]
struct NetPort {
    allowed: u64,
    port: u64,
}

/// Calls a block never needs and an escape would: debugging and reading other processes,
/// loading kernel code, mounting, keyrings, new namespaces, and the like.
const DENIED: &[i64] = &[
    nix::libc::SYS_ptrace,
    nix::libc::SYS_process_vm_readv,
    nix::libc::SYS_process_vm_writev,
    nix::libc::SYS_bpf,
    nix::libc::SYS_mount,
    nix::libc::SYS_umount2,
    nix::libc::SYS_pivot_root,
    nix::libc::SYS_chroot,
    nix::libc::SYS_keyctl,
    nix::libc::SYS_add_key,
    nix::libc::SYS_request_key,
    nix::libc::SYS_unshare,
    nix::libc::SYS_setns,
    nix::libc::SYS_perf_event_open,
    nix::libc::SYS_kexec_load,
    nix::libc::SYS_init_module,
    nix::libc::SYS_finit_module,
    nix::libc::SYS_delete_module,
    nix::libc::SYS_userfaultfd,
    nix::libc::SYS_open_by_handle_at,
    nix::libc::SYS_fsopen,
    nix::libc::SYS_fsmount,
    nix::libc::SYS_move_mount,
    nix::libc::SYS_open_tree,
    // Its flags are behind a pointer, where a filter cannot look: libc falls back to clone.
    nix::libc::SYS_clone3,
    // io_uring makes sockets and opens files without the calls filtered here.
    nix::libc::SYS_io_uring_setup,
    nix::libc::SYS_io_uring_enter,
    nix::libc::SYS_io_uring_register,
];

/// The seccomp program, built once: `ENOSYS` for [`DENIED`], for `clone` with a new user
/// namespace and for a new Unix socket; everything else allowed.
fn seccomp_hex() -> &'static str {
    static PROGRAM: OnceLock<String> = OnceLock::new();
    PROGRAM.get_or_init(|| match build_seccomp() {
        Ok(program) => program
            .iter()
            .flat_map(|f| {
                let mut b = Vec::with_capacity(8);
                b.extend_from_slice(&f.code.to_ne_bytes());
                b.push(f.jt);
                b.push(f.jf);
                b.extend_from_slice(&f.k.to_ne_bytes());
                b
            })
            .map(|byte| format!("{byte:02x}"))
            .collect(),
        Err(e) => {
            // The rules are constants; this is a bug, and confinement then fails closed.
            tracing::error!(error = %e, "building the seccomp program failed");
            "zz".to_owned()
        }
    })
}

fn build_seccomp() -> Result<BpfProgram, seccompiler::BackendError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|&call| (call, Vec::new())).collect();
    let new_user = u64::try_from(nix::libc::CLONE_NEWUSER).unwrap_or(0x1000_0000);
    rules.insert(
        nix::libc::SYS_clone,
        vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(new_user),
            new_user,
        )?])?],
    );
    // A Unix socket that some process of this user listens on (the daemon's, which takes
    // no token; an agent's; a desktop bus) is a way out that neither Landlock nor the network
    // namespace closes: connecting to a path is not a file access, and the path is not in
    // any namespace. No new one is made; `socketpair` (pipes between a block's processes)
    // stays.
    rules.insert(
        nix::libc::SYS_socket,
        vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            u64::try_from(nix::libc::AF_UNIX).unwrap_or(1),
        )?])?],
    );
    let arch = seccompiler::TargetArch::try_from(std::env::consts::ARCH)?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(u32::try_from(nix::libc::ENOSYS).unwrap_or(38)),
        arch,
    )?;
    filter.try_into()
}
