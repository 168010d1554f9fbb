//! The control socket: one JSON request per line, one JSON answer per line.
//!
//! ```text
//! {"op":"status"}
//! {"op":"job-add","hints":"/path/render.hints","name":"render"}   (name optional)
//! {"op":"job-add","name":"scan","record":"/path/scan.hints"}      (hints optional)
//! {"op":"job-remove","name":"render"}
//! {"op":"job-list"}
//! ```
//!
//! Answers are `{"ok":true,...}` or `{"ok":false,"error":"..."}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::{Daemon, JobError};

/// The control socket not listening, a request refused, or the daemon not
/// answering one.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control socket {}: exists and is not a socket", path.display())]
    NotASocket { path: PathBuf },
    #[error("control socket {}: another prefetchd answers on it", path.display())]
    InUse { path: PathBuf },
    #[error("removing stale socket {}", path.display())]
    RemoveStale {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("control socket {}", path.display())]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The accept thread not starting, or a request not sent.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("request without \"op\"")]
    NoOp,
    #[error("job-add without \"hints\" or \"record\"")]
    JobAddWithoutFile,
    #[error("job-remove without \"name\"")]
    JobRemoveWithoutName,
    #[error("unknown op {0:?} (status, job-add, job-remove, job-list)")]
    UnknownOp(String),
    #[error(transparent)]
    Job(#[from] JobError),
    #[error("cannot reach prefetchd on {} (is it running?)", path.display())]
    Unreachable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("reading the answer")]
    ReadAnswer(#[source] std::io::Error),
    #[error("answer is not JSON: {line:?}")]
    AnswerNotJson {
        line: String,
        source: serde_json::Error,
    },
    /// The daemon's `error`.
    #[error("{0}")]
    Refused(String),
}

/// The listening socket and its accept thread.
pub struct ControlServer {
    path: PathBuf,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Listens on `path` (replacing a stale socket nobody answers on).
    pub fn start(path: &Path, daemon: Arc<Daemon>) -> Result<ControlServer, ControlError> {
        let path_buf = || path.to_path_buf();
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(ControlError::NotASocket { path: path_buf() });
            }
            if UnixStream::connect(path).is_ok() {
                return Err(ControlError::InUse { path: path_buf() });
            }
            std::fs::remove_file(path).map_err(|source| ControlError::RemoveStale {
                path: path_buf(),
                source,
            })?;
        }
        let socket = |source| ControlError::Socket {
            path: path_buf(),
            source,
        };
        let listener = UnixListener::bind(path).map_err(socket)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(socket)?;
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    match conn {
                        Ok(c) => {
                            let d = daemon.clone();
                            let spawned = std::thread::Builder::new()
                                .name("control-conn".into())
                                .spawn(move || serve_conn(c, &d));
                            if let Err(e) = spawned {
                                tracing::warn!("control connection: cannot start a thread: {e}");
                            }
                        }
                        Err(e) => tracing::warn!("control socket accept: {e}"),
                    }
                }
            })?;
        Ok(ControlServer {
            path: path.to_path_buf(),
            stopping,
            thread: Some(thread),
        })
    }

    /// Stops accepting and removes the socket file.
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        // Wake the accept loop with a connection of our own.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve_conn(conn: UnixStream, daemon: &Arc<Daemon>) {
    let Ok(writer) = conn.try_clone() else { return };
    let mut writer = writer;
    for line in BufReader::new(conn).lines() {
        let Ok(line) = line else { return };
        if line.trim().is_empty() {
            continue;
        }
        let answer = match serde_json::from_str::<Value>(&line) {
            Ok(req) => handle(&req, daemon)
                .unwrap_or_else(|e| json!({"ok": false, "error": crate::error_chain(&e)})),
            Err(e) => json!({"ok": false, "error": format!("request is not JSON: {e}")}),
        };
        if writeln!(writer, "{answer}").is_err() {
            return;
        }
    }
}

fn handle(req: &Value, daemon: &Arc<Daemon>) -> Result<Value, ControlError> {
    let op = req["op"].as_str().ok_or(ControlError::NoOp)?;
    let name = req["name"].as_str();
    Ok(match op {
        "status" => json!({"ok": true, "status": daemon.status()}),
        "job-add" => {
            let hints = req["hints"].as_str().map(Path::new);
            let record = req["record"].as_str().map(Path::new);
            if hints.is_none() && record.is_none() {
                return Err(ControlError::JobAddWithoutFile);
            }
            let added = daemon.add_job(name, hints, record)?;
            json!({"ok": true, "added": added})
        }
        "job-remove" => {
            let recorded = daemon.remove_job(name.ok_or(ControlError::JobRemoveWithoutName)?)?;
            json!({"ok": true, "recorded": recorded})
        }
        "job-list" => json!({"ok": true, "jobs": daemon.job_names()}),
        other => return Err(ControlError::UnknownOp(other.to_owned())),
    })
}

/// Sends one request to the daemon at `path` and returns its answer, or
/// the daemon's error.
pub fn request(path: &Path, req: &Value) -> Result<Value, ControlError> {
    let mut conn = UnixStream::connect(path).map_err(|source| ControlError::Unreachable {
        path: path.to_path_buf(),
        source,
    })?;
    conn.set_read_timeout(Some(Duration::from_secs(60)))?;
    writeln!(conn, "{req}")?;
    let mut line = String::new();
    BufReader::new(&conn)
        .read_line(&mut line)
        .map_err(ControlError::ReadAnswer)?;
    let answer: Value =
        serde_json::from_str(&line).map_err(|source| ControlError::AnswerNotJson {
            line: line.clone(),
            source,
        })?;
    if answer["ok"].as_bool() != Some(true) {
        return Err(ControlError::Refused(
            answer["error"]
                .as_str()
                .unwrap_or("prefetchd refused the request")
                .to_owned(),
        ));
    }
    Ok(answer)
}
