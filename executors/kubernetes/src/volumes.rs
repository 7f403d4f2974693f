//! Tandem volumes on a cluster: each is a `PersistentVolumeClaim` of its own
//! (`tandem-volume-NAME`), made on first use and never deleted by Tandem, mounted into a
//! `Sandbox` that Tandem makes for the session from the warm pool's template (a pod from
//! the pool was started without it).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value, json};
use tandem_executor::{ExecError, VolumeBinding};

use crate::{KubernetesError, KubernetesExecutor, labels};

/// The size of a volume's claim when the volume has no quota.
pub const DEFAULT_VOLUME_MB: u64 = 1024;

/// The `PersistentVolumeClaim` that holds Tandem volume `name` on a cluster: a valid object
/// name for every valid volume name, and a different one for each. A name an object name
/// cannot be (one with `_`, or ending in `-`) becomes `-`s, its end trimmed, with the whole
/// name's hash after a `.`, which volume names cannot hold.
pub fn claim_name(name: &str) -> String {
    if !name.contains('_') && !name.ends_with('-') {
        return format!("tandem-volume-{name}");
    }
    // FNV-1a: stable across builds and machines, which the name must be.
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!(
        "tandem-volume-{}.{hash:016x}",
        name.replace('_', "-").trim_end_matches('-')
    )
}

/// `template` (a pod template: `metadata` and `spec`) with each of `volumes` mounted from its
/// claim into the runner's container (`container`, else the first); refused when a volume
/// would go inside the workspace or over a place the template already mounts.
pub fn pod_template_with(
    template: &Value,
    container: Option<&str>,
    volumes: &[VolumeBinding],
) -> Result<Value, ExecError> {
    let mut template = template.clone();
    let spec = template
        .get_mut("spec")
        .filter(|s| s.is_object())
        .ok_or_else(|| ExecError::Backend("the SandboxTemplate has no pod spec".to_owned()))?;
    let containers = spec
        .get_mut("containers")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| {
            ExecError::Backend("the SandboxTemplate's pod has no containers".to_owned())
        })?;
    let index = match container {
        Some(wanted) => containers
            .iter()
            .position(|c| c["name"].as_str() == Some(wanted))
            .ok_or_else(|| {
                ExecError::Backend(format!(
                    "the SandboxTemplate's pod has no container `{wanted}` ([executors.kubernetes] container)"
                ))
            })?,
        None => 0,
    };
    let target = containers.get_mut(index).ok_or_else(|| {
        ExecError::Backend("the SandboxTemplate's pod has no containers".to_owned())
    })?;
    let mut taken: Vec<String> = target["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            m["mountPath"]
                .as_str()
                .map(|p| p.trim_end_matches('/').to_owned())
        })
        .collect();
    let mut mounts = Vec::new();
    let mut sources = Vec::new();
    for (i, v) in volumes.iter().enumerate() {
        if !v.path.starts_with('/') {
            return Err(ExecError::Unavailable {
                what: format!("volume `{}` inside the workspace", v.name),
                hint: "a pod's workspace is copied out after each block, and a volume inside it would be copied too: mount it at an absolute path such as /data".to_owned(),
            });
        }
        let path = v.path.trim_end_matches('/');
        if let Some(place) = taken.iter().find(|t| {
            path == t.as_str()
                || path.starts_with(&format!("{t}/"))
                || t.starts_with(&format!("{path}/"))
        }) {
            return Err(ExecError::Unavailable {
                what: format!("volume `{}` at {path}", v.name),
                hint: format!(
                    "{place} is already mounted there (by the sandbox template or another volume); mount the volume elsewhere, such as /data"
                ),
            });
        }
        taken.push(path.to_owned());
        let volume = format!("tandem-volume-{i}");
        mounts.push(json!({
            "name": volume,
            "mountPath": path,
            "readOnly": v.read_only,
        }));
        sources.push(json!({
            "name": volume,
            "persistentVolumeClaim": {"claimName": claim_name(&v.name), "readOnly": v.read_only},
        }));
    }
    push_all(target, "volumeMounts", mounts);
    push_all(spec, "volumes", sources);
    Ok(template)
}

/// Appends `items` to the array at `object[field]`, making it when absent.
fn push_all(object: &mut Value, field: &str, items: Vec<Value>) {
    match object.get_mut(field).and_then(Value::as_array_mut) {
        Some(list) => list.extend(items),
        None => object[field] = Value::Array(items),
    }
}

/// A claim's body for volume `v`: its quota as its size, else [`DEFAULT_VOLUME_MB`].
fn claim_body(
    v: &VolumeBinding,
    access_mode: &str,
    storage_class: Option<&str>,
) -> Result<PersistentVolumeClaim, ExecError> {
    let mut spec = json!({
        "accessModes": [access_mode],
        "resources": {"requests": {"storage": format!("{}Mi", v.max_mb.unwrap_or(DEFAULT_VOLUME_MB))}},
    });
    if let Some(class) = storage_class {
        spec["storageClassName"] = json!(class);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": claim_name(&v.name),
            "labels": BTreeMap::from([(labels::MANAGED_BY, "tandem")]),
            // An annotation: a label value cannot end in `_` or `-`, which a volume name can.
            "annotations": BTreeMap::from([(labels::VOLUME, v.name.clone())]),
        },
        "spec": spec,
    }))
    .map_err(|e| ExecError::Backend(format!("a volume's claim: {e}")))
}

impl KubernetesExecutor {
    /// Makes each of `volumes`' claims that the namespace does not hold yet; one already
    /// there (another session's, or made by the operator) is used as it is.
    pub(crate) async fn ensure_volumes(&self, volumes: &[VolumeBinding]) -> Result<(), ExecError> {
        let config = &self.inner.config;
        let claims: Api<PersistentVolumeClaim> =
            Api::namespaced(self.inner.client.clone(), &config.namespace);
        for v in volumes {
            let name = claim_name(&v.name);
            if self
                .request(
                    "reading a volume's PersistentVolumeClaim",
                    claims.get_opt(&name),
                )
                .await?
                .is_some()
            {
                continue;
            }
            let body = claim_body(
                v,
                &config.volume_access_mode,
                config.volume_storage_class.as_deref(),
            )?;
            match self
                .request(
                    "creating a volume's PersistentVolumeClaim",
                    claims.create(&PostParams::default(), &body),
                )
                .await
            {
                Ok(_) => tracing::info!(volume = %v.name, claim = %name, "made the volume's claim"),
                // Another session made it meanwhile.
                Err(KubernetesError::Api { reason, .. }) if reason.contains("AlreadyExists") => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// The pod template of the warm pool's `SandboxTemplate`.
    pub(crate) async fn pool_pod_template(&self) -> Result<Value, ExecError> {
        let config = &self.inner.config;
        let pools: Api<DynamicObject> = Api::namespaced_with(
            self.inner.client.clone(),
            &config.namespace,
            &crate::warm_pools_resource(),
        );
        let pool = self
            .request("reading the warm pool", pools.get_opt(&config.warm_pool))
            .await?
            .ok_or_else(|| KubernetesError::NoWarmPool {
                pool: config.warm_pool.clone(),
                namespace: config.namespace.clone(),
            })?;
        let template_name = pool.data["spec"]["sandboxTemplateRef"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let templates: Api<DynamicObject> = Api::namespaced_with(
            self.inner.client.clone(),
            &config.namespace,
            &crate::templates_resource(),
        );
        let template = self
            .request("reading the SandboxTemplate", templates.get_opt(&template_name))
            .await?
            .ok_or_else(|| {
                ExecError::Backend(format!(
                    "the warm pool `{}` names SandboxTemplate `{template_name}`, which namespace `{}` does not hold",
                    config.warm_pool, config.namespace
                ))
            })?;
        Ok(template.data["spec"]["podTemplate"].clone())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn volume(name: &str, path: &str, read_only: bool) -> VolumeBinding {
        VolumeBinding {
            name: name.to_owned(),
            host_dir: PathBuf::from("/nowhere"),
            path: path.to_owned(),
            read_only,
            max_mb: None,
        }
    }

    fn template() -> Value {
        json!({
            "metadata": {"labels": {"app.kubernetes.io/name": "tandem-sandbox"}},
            "spec": {
                "containers": [
                    {"name": "side", "image": "x"},
                    {"name": "sandbox", "image": "y", "volumeMounts": [
                        {"name": "workspace", "mountPath": "/workspace"},
                        {"name": "tmp", "mountPath": "/tmp/"},
                    ]},
                ],
                "volumes": [{"name": "workspace", "emptyDir": {}}],
            },
        })
    }

    #[test]
    fn claim_names_are_object_names_and_differ_per_volume() {
        assert_eq!(claim_name("data"), "tandem-volume-data");
        let (a, b) = (claim_name("a_b"), claim_name("a-b"));
        assert_ne!(a, b);
        assert!(a.starts_with("tandem-volume-a-b."), "{a}");
        assert_ne!(
            claim_name(&a["tandem-volume-".len()..].replace('.', "-")),
            a
        );
        assert_ne!(claim_name("a_b"), claim_name("a__b"));
        assert_eq!(claim_name("x_y"), claim_name("x_y"));
        // Every part between dots starts and ends with a letter or digit, as object names must.
        for name in [
            "z_".repeat(32),
            "data-".to_owned(),
            "a_".to_owned(),
            "x".repeat(64),
            "q--".to_owned(),
        ] {
            let claim = claim_name(&name);
            assert!(claim.len() <= 253, "{claim}");
            for part in claim.split('.') {
                assert!(
                    !part.is_empty()
                        && part
                            .bytes()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-'),
                    "{claim}"
                );
                assert!(
                    part.starts_with(|c: char| c.is_ascii_alphanumeric())
                        && part.ends_with(|c: char| c.is_ascii_alphanumeric()),
                    "{claim}"
                );
            }
        }
        assert_ne!(claim_name("data-"), claim_name("data"));
    }

    #[test]
    fn volumes_are_mounted_into_the_runners_container_read_only_where_asked() {
        let made = pod_template_with(
            &template(),
            Some("sandbox"),
            &[
                volume("data", "/data", false),
                volume("ref", "/srv/ref/", true),
            ],
        )
        .unwrap();
        let mounts = &made["spec"]["containers"][1]["volumeMounts"];
        assert_eq!(mounts.as_array().unwrap().len(), 4);
        assert_eq!(
            mounts[2],
            json!({"name": "tandem-volume-0", "mountPath": "/data", "readOnly": false})
        );
        assert_eq!(mounts[3]["mountPath"], "/srv/ref");
        assert_eq!(mounts[3]["readOnly"], true);
        assert!(made["spec"]["containers"][0].get("volumeMounts").is_none());
        let sources = made["spec"]["volumes"].as_array().unwrap();
        assert_eq!(
            sources[1]["persistentVolumeClaim"],
            json!({"claimName": "tandem-volume-data", "readOnly": false})
        );
        assert_eq!(sources[2]["persistentVolumeClaim"]["readOnly"], true);
        assert_eq!(made["metadata"], template()["metadata"]);
    }

    #[test]
    fn a_volume_inside_the_workspace_or_over_the_templates_mounts_is_refused() {
        for path in ["data", "/workspace/data", "/tmp", "/tmp/x"] {
            let e = pod_template_with(&template(), Some("sandbox"), &[volume("v", path, false)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("/data"), "{path}: {e}");
        }
        // Two volumes at one place, however the path was written.
        let e = pod_template_with(
            &template(),
            Some("sandbox"),
            &[volume("a", "/data", false), volume("b", "/data/", false)],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("another volume"), "{e}");
        let e = pod_template_with(&template(), Some("nope"), &[volume("v", "/data", false)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`nope`"), "{e}");
        // The first container when none is named.
        let made = pod_template_with(&template(), None, &[volume("v", "/data", false)]).unwrap();
        assert_eq!(
            made["spec"]["containers"][0]["volumeMounts"][0]["mountPath"],
            "/data"
        );
    }
}
