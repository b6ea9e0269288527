//! The profile cache: one file per measured config (`ckptune.profile-cache/1`), keyed by
//! everything the measurement depends on.

use serde::{Deserialize, Serialize};

use super::ModelJson;
use crate::profile::ConfigProfile;

/// One cached config profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachedConfig {
    pub format: String,
    /// The cache key the file was written under; a file whose key differs is not used.
    pub key: String,
    pub model: ModelJson,
    pub profile: ConfigProfile,
}
