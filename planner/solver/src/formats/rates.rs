//! A CPU's calibrated rates as cached (`ckptune.cpu-rates/1`): one file per CPU identity and
//! thread count, written by the runtime's calibration run and read instead of running it again.

use serde::{Deserialize, Serialize};

use crate::rates::DeviceRates;

/// One cached calibration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachedRates {
    pub format: String,
    /// What the rates depend on (the CPU's identity, the thread count, the calibration's
    /// version); a file whose key differs is not used.
    pub key: String,
    pub rates: DeviceRates,
    /// Cores the rest of the machine kept busy while the calibration ran (`None`: not known,
    /// `/proc` unreadable). A busy calibration is measured again once the machine is quiet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_cores: Option<f64>,
}
