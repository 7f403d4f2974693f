//! A PEP 503 simple index of real wheels, built here (no registry is asked): what the
//! package cache's tests serve from the stand-in internet.

use std::path::Path;
use std::process::Command;

/// Builds `NAME-VERSION-py3-none-any.whl`, a pure-Python package whose module `NAME`
/// holds `source`, and an index for it under `root`: `simple/NAME/index.html` links
/// `packages/…whl#sha256=…`. Answers the wheel's sha256.
pub fn build_index(root: &Path, name: &str, version: &str, source: &str) -> String {
    const SCRIPT: &str = r#"
import base64, hashlib, os, sys, zipfile
root, name, version, source = sys.argv[1:5]
dist = f"{name}-{version}.dist-info"
files = {
    f"{name}/__init__.py": source.encode(),
    f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
    f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tandem-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for path, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record += f"{path},sha256={digest},{len(data)}\n"
record += f"{dist}/RECORD,,\n"
files[f"{dist}/RECORD"] = record.encode()
wheel = f"{name}-{version}-py3-none-any.whl"
os.makedirs(os.path.join(root, "packages"), exist_ok=True)
os.makedirs(os.path.join(root, "simple", name), exist_ok=True)
path = os.path.join(root, "packages", wheel)
with zipfile.ZipFile(path, "w") as z:
    for name_in, data in files.items():
        z.writestr(name_in, data)
sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
with open(os.path.join(root, "simple", name, "index.html"), "w") as page:
    page.write(f'<!DOCTYPE html><html><body><a href="../../packages/{wheel}#sha256={sha}">{wheel}</a></body></html>\n')
with open(os.path.join(root, "simple", "index.html"), "w") as page:
    page.write(f'<!DOCTYPE html><html><body><a href="{name}/">{name}</a></body></html>\n')
print(sha)
"#;
    let out = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(root)
        .args([name, version, source])
        .output()
        .unwrap_or_else(|e| panic!("building a wheel needs python3: {e}"));
    assert!(
        out.status.success(),
        "building the wheel: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
