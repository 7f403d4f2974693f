//! Python tracebacks cut to what the model can act on: the frames of its own code and the
//! exception, without the frames inside libraries or the chained tracebacks before the last.

/// `stderr` with its last Python traceback cut to the model's own frames; text around the
/// traceback, and stderr with no traceback, are kept as they are.
pub fn trim(stderr: &str) -> String {
    const HEAD: &str = "Traceback (most recent call last):";
    let Some(start) = stderr.rfind(HEAD) else {
        return stderr.to_owned();
    };
    // What came before the first traceback is the program's own output to stderr.
    let before = stderr.find(HEAD).map_or("", |first| &stderr[..first]);
    let lines: Vec<&str> = stderr[start + HEAD.len()..].lines().skip(1).collect();
    let mut kept = vec![HEAD.to_owned()];
    let mut left_out = 0usize;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let Some(file) = frame_file(line) else {
            break;
        };
        // A frame is its `File` line and the indented lines under it (source, carets).
        let mut end = i + 1;
        while end < lines.len()
            && lines[end].starts_with("    ")
            && frame_file(lines[end]).is_none()
        {
            end += 1;
        }
        if is_library(file) {
            left_out += 1;
        } else {
            kept.extend(lines[i..end].iter().map(|l| (*l).to_owned()));
        }
        i = end;
    }
    if left_out > 0 {
        kept.push(format!(
            "  [{left_out} frame{} inside libraries left out]",
            if left_out == 1 { "" } else { "s" }
        ));
    }
    kept.extend(lines[i..].iter().map(|l| (*l).to_owned()));
    let mut out = before.to_owned();
    out.push_str(&kept.join("\n"));
    if stderr.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// The file of a traceback frame's first line (`  File "x.py", line 3, in f`).
fn frame_file(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("  File \"")?;
    rest.split_once('"').map(|(file, _)| file)
}

/// Whether `file` is a library's, not the model's code.
fn is_library(file: &str) -> bool {
    file.contains("/site-packages/")
        || file.contains("/dist-packages/")
        || file.contains("/lib/python3")
        || file.starts_with("<frozen")
        || file.ends_with(".pyx")
        || file.ends_with(".pxi")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chained_library_traceback_keeps_the_models_frames_and_the_exception() {
        let stderr = r#"Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/pandas/core/indexes/base.py", line 3802, in get_loc
    return self._engine.get_loc(casted_key)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "pandas/_libs/index.pyx", line 138, in pandas._libs.index.IndexEngine.get_loc
KeyError: 'b'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/workspace/.tandem-block-1.py", line 5, in <module>
    f()
  File "/workspace/.tandem-block-1.py", line 4, in f
    return df["b"]
           ~~^^^^^
  File "/usr/lib/python3/dist-packages/pandas/core/frame.py", line 3807, in __getitem__
    indexer = self.columns.get_loc(key)
              ^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/usr/lib/python3/dist-packages/pandas/core/indexes/base.py", line 3804, in get_loc
    raise KeyError(key) from err
KeyError: 'b'
"#;
        assert_eq!(
            trim(stderr),
            r#"Traceback (most recent call last):
  File "/workspace/.tandem-block-1.py", line 5, in <module>
    f()
  File "/workspace/.tandem-block-1.py", line 4, in f
    return df["b"]
           ~~^^^^^
  [2 frames inside libraries left out]
KeyError: 'b'
"#
        );
    }

    #[test]
    fn other_stderr_is_kept_as_it_is() {
        let own = "warning: x\nTraceback (most recent call last):\n  File \"main.py\", line 1, in <module>\n    1/0\nZeroDivisionError: division by zero\n";
        assert_eq!(trim(own), own);
        assert_eq!(trim("just a message\n"), "just a message\n");
        assert_eq!(trim(""), "");
    }
}
