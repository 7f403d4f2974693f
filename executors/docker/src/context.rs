//! The docker CLI's contexts: which engine `docker` talks to when `DOCKER_HOST` is not set,
//! read the way the CLI reads them, so Tandem talks to the same one.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::TlsFiles;

/// The engine of the docker CLI's current context (`DOCKER_CONTEXT`, else `currentContext`
/// in `config.json` of `config_dir`): its address and, when the context stores them, its
/// TLS files. `None` for the default context or when there is none.
pub fn current_context(
    config_dir: &Path,
    env_context: Option<&str>,
) -> Option<(String, Option<TlsFiles>)> {
    let name = match env_context {
        Some(name) => name.to_owned(),
        None => {
            let config = std::fs::read_to_string(config_dir.join("config.json")).ok()?;
            let config: serde_json::Value = serde_json::from_str(&config).ok()?;
            config.get("currentContext")?.as_str()?.to_owned()
        }
    };
    if name.is_empty() || name == "default" {
        return None;
    }
    // Contexts are stored under the hex SHA-256 of their name.
    let id = hex::encode(Sha256::digest(name.as_bytes()));
    let meta =
        std::fs::read_to_string(config_dir.join("contexts/meta").join(&id).join("meta.json"))
            .ok()?;
    let meta: serde_json::Value = serde_json::from_str(&meta).ok()?;
    let host = meta
        .get("Endpoints")?
        .get("docker")?
        .get("Host")?
        .as_str()?
        .to_owned();
    let tls_dir: PathBuf = config_dir.join("contexts/tls").join(&id).join("docker");
    let tls = ["ca.pem", "cert.pem", "key.pem"]
        .iter()
        .all(|f| tls_dir.join(f).is_file())
        .then(|| TlsFiles {
            ca: tls_dir.join("ca.pem"),
            cert: tls_dir.join("cert.pem"),
            key: tls_dir.join("key.pem"),
        });
    Some((host, tls))
}

/// The docker CLI's configuration directory: `DOCKER_CONFIG`, else `~/.docker`.
pub fn config_dir() -> Option<PathBuf> {
    std::env::var_os("DOCKER_CONFIG")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_current_context_names_its_engine_and_tls_files() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("config.json"), r#"{"currentContext": "remote"}"#).unwrap();
        let id = hex::encode(Sha256::digest(b"remote"));
        let meta = d.join("contexts/meta").join(&id);
        std::fs::create_dir_all(&meta).unwrap();
        std::fs::write(
            meta.join("meta.json"),
            r#"{"Name":"remote","Endpoints":{"docker":{"Host":"tcp://10.1.2.3:2376","SkipTLSVerify":false}}}"#,
        )
        .unwrap();
        assert_eq!(
            current_context(d, None),
            Some(("tcp://10.1.2.3:2376".to_owned(), None))
        );
        let tls = d.join("contexts/tls").join(&id).join("docker");
        std::fs::create_dir_all(&tls).unwrap();
        for f in ["ca.pem", "cert.pem", "key.pem"] {
            std::fs::write(tls.join(f), "x").unwrap();
        }
        let (_, files) = current_context(d, None).unwrap();
        assert_eq!(files.unwrap().cert, tls.join("cert.pem"));
        assert_eq!(current_context(d, Some("default")), None);
        assert_eq!(current_context(d, Some("missing")), None);
    }
}
