//! How likely each mode is to lose data, from how often donors fail and
//! how long a rebuild takes (`pagerctl durability`).
//!
//! The model: donors fail independently at a constant rate λ; a failed
//! member is re-created on another donor after the rebuild time on average
//! (exponentially distributed, members rebuilt in parallel, rate μ each).
//! A group of `n` members that survives `t` failures (none: 1+0, mirror:
//! 2 copies, t = 1; parity: width w, t = 1; ec k+r: n = k + r, t = r) loses
//! data when `t + 1` of its members are down at once. That is a birth-death
//! chain on the number of members down, absorbed at `t + 1`; its mean time
//! to absorption from 0 is the MTTDL, and the chance of loss within a
//! mission time M is `1 - exp(-M / MTTDL)` (absorption from a chain that
//! repairs much faster than it fails is close to exponential).
//!
//! "One group" is a single stripe's chance. "Device" takes the device's
//! groups as spread over all `N` donors so that any `t + 1` donors down at
//! once hold `t + 1` members of some group: the same chain over `N`
//! donors, an upper bound that a device with many groups reaches.

use serde::Serialize;

/// A mode's redundancy for the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Scheme {
    /// `none`, `mirror`, `parity` or `ec`.
    pub mode: &'static str,
    /// Members of a group (copies, or data plus parity extents).
    pub members: u32,
    /// Members a group can lose and still be read.
    pub tolerates: u32,
    /// Members that hold data (remote memory per byte stored is
    /// `members / data`).
    pub data: u32,
}

impl Scheme {
    pub fn none() -> Scheme {
        Scheme {
            mode: "none",
            members: 1,
            tolerates: 0,
            data: 1,
        }
    }
    pub fn mirror() -> Scheme {
        Scheme {
            mode: "mirror",
            members: 2,
            tolerates: 1,
            data: 1,
        }
    }
    pub fn parity(width: u32) -> Scheme {
        Scheme {
            mode: "parity",
            members: width,
            tolerates: 1,
            data: width - 1,
        }
    }
    pub fn ec(k: u32, r: u32) -> Scheme {
        Scheme {
            mode: "ec",
            members: k + r,
            tolerates: r,
            data: k,
        }
    }

    /// `1+0`, `1+1`, `2+1`, `4+2`: data and redundant members.
    pub fn code(&self) -> String {
        format!("{}+{}", self.data, self.members - self.data)
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DurabilityError {
    #[error("{what} must be a positive finite number, got {value}")]
    NotPositive { what: &'static str, value: f64 },
    #[error("{mode} {code} needs {members} donors, only {donors} given")]
    TooFewDonors {
        mode: &'static str,
        code: String,
        members: u32,
        donors: u32,
    },
}

/// Inputs, in hours.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Inputs {
    /// Failures per donor per hour (λ).
    pub failure_rate: f64,
    /// Mean time to re-create a lost member (1/μ).
    pub rebuild_hours: f64,
    /// Mission time M.
    pub mission_hours: f64,
    /// Donors the device's groups spread over.
    pub donors: u32,
}

/// One mode's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub mode: &'static str,
    pub code: String,
    /// Remote memory per byte stored.
    pub overhead: f64,
    pub tolerates: u32,
    /// Mean time to data loss of one group, hours.
    pub group_mttdl_hours: f64,
    /// Chance one group loses data within the mission time.
    pub group_loss: f64,
    /// Chance the device loses data within the mission time (all groups).
    pub device_loss: f64,
}

/// Mean time until `t + 1` of `n` members are down at once, starting with
/// all up: expected absorption time of the birth-death chain (up rate
/// `(n - i) λ`, down rate `i μ`), solved as a tridiagonal system.
pub fn mttdl(n: u32, t: u32, lambda: f64, mu: f64) -> f64 {
    // T_i = 1/(a_i + b_i) + a_i/(a_i + b_i) T_{i+1} + b_i/(a_i + b_i) T_{i-1},
    // T_{t+1} = 0. Write T_i = c_i + d_i T_{i+1} from i = 0 up.
    let (mut c, mut d) = (0.0f64, 0.0f64);
    let mut cs = Vec::with_capacity(t as usize + 1);
    let mut ds = Vec::with_capacity(t as usize + 1);
    for i in 0..=t {
        let a = f64::from(n - i) * lambda;
        let b = f64::from(i) * mu;
        // (a + b) T_i = 1 + a T_{i+1} + b (c + d T_i)
        let denom = a + b - b * d;
        c = (1.0 + b * c) / denom;
        d = a / denom;
        cs.push(c);
        ds.push(d);
    }
    // Back-substitute from T_{t+1} = 0.
    let mut next = 0.0;
    for i in (0..=t as usize).rev() {
        next = cs[i] + ds[i] * next;
    }
    next
}

fn loss(mission: f64, mttdl: f64) -> f64 {
    -(-mission / mttdl).exp_m1()
}

/// The chance of data loss of each scheme.
pub fn evaluate(inputs: &Inputs, schemes: &[Scheme]) -> Result<Vec<Row>, DurabilityError> {
    for (what, value) in [
        ("the failure rate", inputs.failure_rate),
        ("the rebuild time", inputs.rebuild_hours),
        ("the mission time", inputs.mission_hours),
    ] {
        if !(value.is_finite() && value > 0.0) {
            return Err(DurabilityError::NotPositive { what, value });
        }
    }
    let mu = 1.0 / inputs.rebuild_hours;
    schemes
        .iter()
        .map(|s| {
            if s.members > inputs.donors {
                return Err(DurabilityError::TooFewDonors {
                    mode: s.mode,
                    code: s.code(),
                    members: s.members,
                    donors: inputs.donors,
                });
            }
            let group = mttdl(s.members, s.tolerates, inputs.failure_rate, mu);
            let device = mttdl(inputs.donors, s.tolerates, inputs.failure_rate, mu);
            Ok(Row {
                mode: s.mode,
                code: s.code(),
                overhead: f64::from(s.members) / f64::from(s.data),
                tolerates: s.tolerates,
                group_mttdl_hours: group,
                group_loss: loss(inputs.mission_hours, group),
                device_loss: loss(inputs.mission_hours, device),
            })
        })
        .collect()
}

/// The rows as a table.
pub fn to_table(inputs: &Inputs, rows: &[Row]) -> String {
    let mut out = format!(
        "donor failure rate {:.3}/year, rebuild {:.0} s, mission {:.2} years, {} donors\n",
        inputs.failure_rate * 8766.0,
        inputs.rebuild_hours * 3600.0,
        inputs.mission_hours / 8766.0,
        inputs.donors
    );
    out += &format!(
        "{:<7} {:<6} {:>8} {:>9} {:>14} {:>12} {:>12}\n",
        "mode", "code", "memory", "survives", "MTTDL (years)", "P(loss) grp", "P(loss) dev"
    );
    for r in rows {
        out += &format!(
            "{:<7} {:<6} {:>7.2}x {:>9} {:>14.3e} {:>12.3e} {:>12.3e}\n",
            r.mode,
            r.code,
            r.overhead,
            r.tolerates,
            r.group_mttdl_hours / 8766.0,
            r.group_loss,
            r.device_loss
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        ((a - b) / b).abs() < 1e-9
    }

    #[test]
    fn mttdl_matches_the_closed_forms() {
        let (l, m) = (1e-3, 2.0);
        // One member: the first failure.
        assert!(close(mttdl(1, 0, l, m), 1.0 / l));
        assert!(close(mttdl(8, 0, l, m), 1.0 / (8.0 * l)));
        // Mirror: (3λ + μ) / (2λ²).
        assert!(close(mttdl(2, 1, l, m), (3.0 * l + m) / (2.0 * l * l)));
        // RAID-5 of n: ((2n - 1)λ + μ) / (n (n - 1) λ²).
        let n = 4.0;
        assert!(close(
            mttdl(4, 1, l, m),
            ((2.0 * n - 1.0) * l + m) / (n * (n - 1.0) * l * l)
        ));
    }

    fn inputs() -> Inputs {
        Inputs {
            failure_rate: 2.0 / 8766.0,
            rebuild_hours: 60.0 / 3600.0,
            mission_hours: 8766.0,
            donors: 8,
        }
    }

    #[test]
    fn ec_4_2_loses_less_than_parity_and_mirror_for_less_memory_than_mirror() {
        let s = [
            Scheme::none(),
            Scheme::mirror(),
            Scheme::parity(3),
            Scheme::ec(4, 2),
        ];
        let r = evaluate(&inputs(), &s).unwrap();
        let dev: Vec<f64> = r.iter().map(|r| r.device_loss).collect();
        assert!(dev[0] > 0.99, "{dev:?}");
        assert!(dev[3] < dev[1] && dev[1] <= dev[0], "{dev:?}");
        assert!(dev[3] < dev[2], "{dev:?}");
        assert!(r[3].group_loss < r[1].group_loss, "{r:?}");
        assert_eq!((r[3].overhead, r[1].overhead), (1.5, 2.0));
        assert_eq!(r[3].code, "4+2");
        // The device bound is no better than one group.
        for row in &r {
            assert!(row.device_loss >= row.group_loss, "{row:?}");
        }
    }

    #[test]
    fn slower_rebuilds_lose_more() {
        let mut slow = inputs();
        slow.rebuild_hours *= 10.0;
        let s = [Scheme::ec(4, 2)];
        let fast = evaluate(&inputs(), &s).unwrap()[0].device_loss;
        let slow = evaluate(&slow, &s).unwrap()[0].device_loss;
        // Two extra failures inside the window: about 10² times likelier.
        assert!(slow > 50.0 * fast, "{fast} {slow}");
    }

    #[test]
    fn bad_inputs_are_refused_by_name() {
        let mut i = inputs();
        i.rebuild_hours = 0.0;
        let e = evaluate(&i, &[Scheme::none()]).unwrap_err();
        assert!(e.to_string().contains("the rebuild time"), "{e}");
        let mut i = inputs();
        i.donors = 5;
        let e = evaluate(&i, &[Scheme::ec(4, 2)]).unwrap_err().to_string();
        assert_eq!(e, "ec 4+2 needs 6 donors, only 5 given");
    }
}
