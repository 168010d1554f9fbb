//! `prefetchd status` as a table.

use serde_json::Value;

fn triple(v: &Value) -> String {
    format!("{}/{}/{}", v["issued"], v["used"], v["wasted"])
}

fn row(name: &str, state: &str, position: &str, s: &Value) -> Vec<String> {
    vec![
        name.to_owned(),
        state.to_owned(),
        position.to_owned(),
        s["blocks"].to_string(),
        format!(
            "{}/{}/{}",
            s["hits"]["local"], s["hits"]["global"], s["hits"]["disk"]
        ),
        triple(&s["global_to_local"]),
        triple(&s["disk_to_local"]),
        triple(&s["disk_to_global"]),
        format!("{:.3}", s["stall_ns"].as_f64().unwrap_or(0.0) / 1e9),
    ]
}

/// The status answer as a human-readable table.
pub fn status_table(st: &Value) -> String {
    let mut rows = vec![[
        "JOB",
        "STATE",
        "POSITION",
        "BLOCKS",
        "HITS L/G/D",
        "G->L I/U/W",
        "D->L I/U/W",
        "D->G I/U/W",
        "STALL s",
    ]
    .map(str::to_owned)
    .to_vec()];
    for j in st["jobs"].as_array().into_iter().flatten() {
        rows.push(row(
            j["name"].as_str().unwrap_or("?"),
            j["state"].as_str().unwrap_or("?"),
            &j["position"].to_string(),
            &j["stats"],
        ));
    }
    rows.push(row("(unhinted)", "-", "-", &st["unhinted"]));
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str(&format!(
        "local: {}/{} blocks resident, {} filling; costs F_L {:.0} us, F_G {:.0} us, F_D {:.0} us\n",
        st["local"]["resident"],
        st["local"]["blocks"],
        st["local"]["filling"],
        st["costs_ns"]["local"].as_f64().unwrap_or(0.0) / 1e3,
        st["costs_ns"]["global"].as_f64().unwrap_or(0.0) / 1e3,
        st["costs_ns"]["disk"].as_f64().unwrap_or(0.0) / 1e3,
    ));
    for d in st["donors"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "donor {} {} (life {}): {}/{} slots used, {} outstanding{}, {}\n",
            d["id"],
            d["name"].as_str().unwrap_or("?"),
            d["life"],
            d["used"],
            d["slots"],
            d["outstanding"],
            if d["replica"].as_bool() == Some(true) {
                ", replica"
            } else {
                ""
            },
            d["state"].as_str().unwrap_or("?"),
        ));
    }
    for j in st["jobs"].as_array().into_iter().flatten() {
        for s in j["stale"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "job {}: stale hints ignored: {}\n",
                j["name"].as_str().unwrap_or("?"),
                s.as_str().unwrap_or("?")
            ));
        }
        if let Some(e) = j["hint_stream"]["error"].as_str() {
            out.push_str(&format!(
                "job {}: hint stream stopped: {e}\n",
                j["name"].as_str().unwrap_or("?")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn table_shows_each_job_and_level() {
        let stats = json!({"blocks": 10, "hits": {"local": 7, "global": 2, "disk": 1}, "stall_ns": 1_500_000_000u64,
            "global_to_local": {"issued": 3, "used": 2, "wasted": 1},
            "disk_to_local": {"issued": 0, "used": 0, "wasted": 0},
            "disk_to_global": {"issued": 5, "used": 4, "wasted": 0}});
        let st = json!({
            "jobs": [{"name": "render", "state": "following", "position": 9, "stats": stats,
                      "stale": ["scene.db: size differs"], "hint_stream": {"error": null}}],
            "unhinted": stats,
            "local": {"resident": 5, "blocks": 8, "filling": 1},
            "costs_ns": {"local": 20000, "global": 300000, "disk": 13000000},
            "donors": [{"id": 0, "name": "127.0.0.2:10809/", "used": 3, "slots": 8, "outstanding": 1, "replica": true, "alive": false,
                        "life": 2, "state": "let go (draining)"}],
        });
        let t = status_table(&st);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("JOB"));
        assert!(
            lines[1].starts_with("render")
                && lines[1].contains("7/2/1")
                && lines[1].contains("3/2/1")
        );
        assert!(lines[1].ends_with("1.500"));
        assert!(
            t.contains("donor 0 127.0.0.2:10809/ (life 2): 3/8 slots used, 1 outstanding, replica, let go (draining)")
        );
        assert!(t.contains("stale hints ignored: scene.db: size differs"));
    }
}
