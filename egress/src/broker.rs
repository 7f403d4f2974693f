//! Secrets brokered at the egress: a header the proxy adds to requests for one host, whose
//! value the sandbox never holds. For HTTPS the proxy terminates TLS for those hosts only,
//! with a certificate from the daemon's own CA (kept in its state dir, the key never inside a
//! sandbox), and speaks TLS to the host itself; every other host stays a tunnel, end to end.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};

use crate::rule::{HostAsked, normalize_host};

/// A broker that could not be made: the secret or file named, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// A secret's `host` is not a host or `*.domain`.
    #[error("[network.secrets.{name}] host {host:?}: {why}")]
    Host {
        /// The secret's name.
        name: String,
        /// What was given.
        host: String,
        /// Why it is not a host.
        why: String,
    },
    /// A secret's header name is not a header name.
    #[error("[network.secrets.{name}] header {header:?} is not an HTTP header name")]
    Header {
        /// The secret's name.
        name: String,
        /// What was given.
        header: String,
    },
    /// A secret's value would end its header early.
    #[error(
        "[network.secrets.{name}]: its value holds a line break or NUL, which no header value may"
    )]
    Value {
        /// The secret's name.
        name: String,
    },
    /// The CA could not be read or made.
    #[error("the egress CA in {dir}: {why}")]
    Ca {
        /// Where it is kept.
        dir: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// TLS could not be set up.
    #[error("TLS for brokered hosts: {0}")]
    Tls(String),
}

/// One brokered header.
pub struct Secret {
    name: String,
    /// A host, or `.domain` for every name under it.
    host: String,
    wildcard: bool,
    header: String,
    value: String,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret")
            .field("name", &self.name)
            .field("host", &self.host)
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl Secret {
    /// The header `header: value` for `host` (a host or `*.domain`), named `name`.
    pub fn new(name: &str, host: &str, header: &str, value: String) -> Result<Secret, BrokerError> {
        let (wildcard, bare) = match host.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, host),
        };
        let normal = normalize_host(bare).map_err(|why| BrokerError::Host {
            name: name.to_owned(),
            host: host.to_owned(),
            why,
        })?;
        let HostAsked::Name(normal) = normal else {
            return Err(BrokerError::Host {
                name: name.to_owned(),
                host: host.to_owned(),
                why: "an address, not a name: a secret is added for a host TLS can name".to_owned(),
            });
        };
        if header.is_empty()
            || !header
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        {
            return Err(BrokerError::Header {
                name: name.to_owned(),
                header: header.to_owned(),
            });
        }
        if value.contains(['\r', '\n', '\0']) {
            return Err(BrokerError::Value {
                name: name.to_owned(),
            });
        }
        Ok(Secret {
            name: name.to_owned(),
            host: normal,
            wildcard,
            header: header.to_owned(),
            value,
        })
    }

    /// The secret's name, as `[network.secrets.NAME]` gives it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host it is added for, as written.
    pub fn host(&self) -> String {
        if self.wildcard {
            format!("*.{}", self.host)
        } else {
            self.host.clone()
        }
    }

    fn covers(&self, host: &str) -> bool {
        if self.wildcard {
            host.strip_suffix(&self.host)
                .is_some_and(|head| head.len() > 1 && head.ends_with('.'))
        } else {
            host == self.host
        }
    }
}

/// The daemon's CA: the certificate sandboxes trust for brokered hosts, and its key.
pub struct Ca {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    /// One key for every host's certificate: made at start, never written anywhere.
    leaf_key: KeyPair,
    leaves: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

const CA_NAME: &str = "Tandem egress CA";
/// Hosts' certificates kept at once.
const MAX_LEAVES: usize = 1024;

fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = rcgen::date_time_ymd(2025, 1, 1);
    params.not_after = rcgen::date_time_ymd(2045, 1, 1);
    params
}

impl Ca {
    /// The CA kept in `dir` (`ca.pem`, and `ca.key` readable by its owner only), made there
    /// on first use.
    pub fn load_or_make(dir: &Path) -> Result<Ca, BrokerError> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let fail = |why: String| BrokerError::Ca {
            dir: dir.to_owned(),
            why,
        };
        let cert_path = dir.join("ca.pem");
        let key_path = dir.join("ca.key");
        let (cert_pem, key) = if key_path.exists() {
            let key = std::fs::read_to_string(&key_path)
                .map_err(|e| fail(format!("reading ca.key: {e}")))?;
            let cert = std::fs::read_to_string(&cert_path)
                .map_err(|e| fail(format!("reading ca.pem: {e}")))?;
            let key = KeyPair::from_pem(&key).map_err(|e| fail(format!("ca.key: {e}")))?;
            (cert, key)
        } else {
            std::fs::create_dir_all(dir).map_err(|e| fail(e.to_string()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| fail(e.to_string()))?;
            let key = KeyPair::generate().map_err(|e| fail(e.to_string()))?;
            let cert = ca_params()
                .self_signed(&key)
                .map_err(|e| fail(e.to_string()))?;
            let write = |path: &Path, text: &str, mode: u32| -> std::io::Result<()> {
                use std::io::Write;
                let partial = path.with_extension("partial");
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(mode)
                    .open(&partial)?;
                file.write_all(text.as_bytes())?;
                file.sync_all()?;
                std::fs::rename(&partial, path)
            };
            write(&cert_path, &cert.pem(), 0o644).map_err(|e| fail(e.to_string()))?;
            // The key last: a CA with a key and no certificate is never left.
            write(&key_path, &key.serialize_pem(), 0o600).map_err(|e| fail(e.to_string()))?;
            (cert.pem(), key)
        };
        let cert_der = rustls_pemfile_one(&cert_pem)
            .ok_or_else(|| fail("ca.pem holds no certificate".to_owned()))?;
        let leaf_key = KeyPair::generate().map_err(|e| fail(e.to_string()))?;
        Ok(Ca {
            cert_pem,
            cert_der,
            issuer: Issuer::new(ca_params(), key),
            leaf_key,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA's certificate, PEM: what sandboxes trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A TLS server for `host`, with a certificate for it from this CA.
    fn server_for(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, BrokerError> {
        if let Some(config) = self
            .leaves
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(host)
        {
            return Ok(config.clone());
        }
        let tls = |e: &dyn std::fmt::Display| BrokerError::Tls(e.to_string());
        let mut params = CertificateParams::new(vec![host.to_owned()]).map_err(|e| tls(&e))?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, host);
        params.not_before = rcgen::date_time_ymd(2025, 1, 1);
        params.not_after = rcgen::date_time_ymd(2045, 1, 1);
        params.use_authority_key_identifier_extension = true;
        let cert = params
            .signed_by(&self.leaf_key, &self.issuer)
            .map_err(|e| tls(&e))?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.serialize_der()));
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| tls(&e))?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone(), self.cert_der.clone()], key)
        .map_err(|e| tls(&e))?;
        // The request inside is read as HTTP/1.1.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        let mut leaves = self.leaves.lock().unwrap_or_else(PoisonError::into_inner);
        // A wildcard secret covers any name under its domain that a sandbox may ask for:
        // the certificates kept are bounded, and one made again costs a signature.
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host.to_owned(), config.clone());
        Ok(config)
    }
}

/// The first certificate of a PEM text.
fn rustls_pemfile_one(pem: &str) -> Option<CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes()).next()?.ok()
}

/// The secrets, the CA, and how the proxy checks the hosts it speaks TLS to.
pub struct Broker {
    secrets: Vec<Secret>,
    ca: Ca,
    upstream: Arc<rustls::ClientConfig>,
    bundle: Vec<u8>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("secrets", &self.secrets)
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// `secrets` added by the proxy, with certificates from `ca`; hosts it speaks TLS to are
    /// checked against the system's roots and `extra_roots` (PEM files).
    pub fn new(
        secrets: Vec<Secret>,
        ca: Ca,
        extra_roots: &[PathBuf],
    ) -> Result<Broker, BrokerError> {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        for cert in native.certs {
            let _ = roots.add(cert);
        }
        let mut bundle = Vec::new();
        for path in extra_roots {
            let text = std::fs::read(path)
                .map_err(|e| BrokerError::Tls(format!("{}: {e}", path.display())))?;
            for cert in CertificateDer::pem_slice_iter(&text) {
                let cert =
                    cert.map_err(|e| BrokerError::Tls(format!("{}: {e}", path.display())))?;
                roots
                    .add(cert)
                    .map_err(|e| BrokerError::Tls(format!("{}: {e}", path.display())))?;
            }
        }
        // What sandboxes trust: the system's roots, as the image would, and this CA.
        for system in [
            "/etc/ssl/certs/ca-certificates.crt",
            "/etc/pki/tls/certs/ca-bundle.crt",
        ] {
            if let Ok(text) = std::fs::read(system) {
                bundle.extend_from_slice(&text);
                if !bundle.ends_with(b"\n") {
                    bundle.push(b'\n');
                }
                break;
            }
        }
        bundle.extend_from_slice(ca.cert_pem().as_bytes());
        let upstream = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| BrokerError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(Broker {
            secrets,
            ca,
            upstream: Arc::new(upstream),
            bundle,
        })
    }

    /// The secret added for `host`, if any.
    pub(crate) fn for_host(&self, host: &HostAsked) -> Option<&Secret> {
        let HostAsked::Name(name) = host else {
            return None;
        };
        self.secrets.iter().find(|s| s.covers(name))
    }

    /// The secrets' names and hosts (never their values), for the model and `doctor`.
    pub fn hosts(&self) -> Vec<(String, String)> {
        self.secrets
            .iter()
            .map(|s| (s.name.clone(), s.host()))
            .collect()
    }

    /// The certificates a sandbox trusts: the system's and this CA's, PEM.
    pub fn bundle(&self) -> &[u8] {
        &self.bundle
    }

    pub(crate) fn server_for(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, BrokerError> {
        self.ca.server_for(host)
    }

    /// How the proxy checks the hosts it speaks TLS to itself.
    pub fn upstream(&self) -> Arc<rustls::ClientConfig> {
        self.upstream.clone()
    }

    pub(crate) fn server_name(host: &str) -> Option<ServerName<'static>> {
        ServerName::try_from(host.to_owned()).ok()
    }
}

impl Secret {
    /// The header's name.
    pub(crate) fn header(&self) -> &str {
        &self.header
    }

    /// The header's value: only ever written to the host's connection.
    pub(crate) fn value(&self) -> &str {
        &self.value
    }
}

/// A request head with `header` set to `value` (any the client sent of that name dropped).
pub(crate) fn with_header(head: &[u8], header: &str, value: &str) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut lines: Vec<&str> = text.split("\r\n").collect();
    // The head ends in an empty line (and the empty remainder after it).
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        if i > 0
            && line
                .split_once(':')
                .is_some_and(|(name, _)| name.trim().eq_ignore_ascii_case(header))
        {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str(header);
    out.push_str(": ");
    out.push_str(value);
    out.push_str("\r\n\r\n");
    out.into_bytes()
}

/// Masks every copy of a secret's value in a byte stream, across read boundaries: what an
/// upstream echoes back (a header dump, an error page) reaches the sandbox as `*`s of the
/// same length, so lengths the response declares still hold.
pub(crate) struct Scrub {
    needle: Vec<u8>,
    held: Vec<u8>,
}

impl Scrub {
    pub(crate) fn new(value: &str) -> Scrub {
        Scrub {
            needle: value.as_bytes().to_vec(),
            held: Vec::new(),
        }
    }

    /// Takes `bytes`; answers what may be sent on, keeping back a tail that could begin a
    /// copy of the value.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<u8> {
        self.held.extend_from_slice(bytes);
        let n = self.needle.len();
        if n == 0 {
            return std::mem::take(&mut self.held);
        }
        let mut i = 0;
        while i + n <= self.held.len() {
            if self.held[i..i + n] == self.needle[..] {
                self.held[i..i + n].fill(b'*');
                i += n;
            } else {
                i += 1;
            }
        }
        let keep = (n - 1).min(self.held.len());
        let cut = self.held.len() - keep;
        let rest = self.held.split_off(cut);
        std::mem::replace(&mut self.held, rest)
    }

    /// What is left at the end of the stream (too short to hold the value).
    pub(crate) fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_value_split_across_reads_is_masked() {
        let mut scrub = Scrub::new("s3cret-token");
        let mut out = Vec::new();
        for part in ["hello s3c", "ret-to", "ken and s3cret-token", "!", " s3cr"] {
            out.extend(scrub.push(part.as_bytes()));
        }
        out.extend(scrub.finish());
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "hello ************ and ************! s3cr"
        );
    }

    #[test]
    fn the_header_replaces_any_the_client_sent() {
        let head =
            b"GET /x HTTP/1.1\r\nHost: api.test\r\nauthorization: mine\r\nAccept: */*\r\n\r\n";
        let out = String::from_utf8(with_header(head, "Authorization", "Bearer t")).unwrap();
        assert_eq!(
            out,
            "GET /x HTTP/1.1\r\nHost: api.test\r\nAccept: */*\r\nAuthorization: Bearer t\r\n\r\n"
        );
    }

    #[test]
    fn a_wildcard_secret_covers_subdomains_only() {
        let s = Secret::new("gh", "*.example.com", "Authorization", "x".into()).unwrap();
        assert!(s.covers("api.example.com"));
        assert!(!s.covers("example.com"));
        assert!(!s.covers("badexample.com"));
        assert!(Secret::new("gh", "api.test", "Bad Header", "x".into()).is_err());
        assert!(Secret::new("gh", "203.0.113.5", "Authorization", "x".into()).is_err());
    }
}
