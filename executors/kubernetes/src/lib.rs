//! Tandem's Kubernetes executor: one agent-sandbox claim per task session, the runner over pod exec.
