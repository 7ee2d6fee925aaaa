//! A pod's flags and their letters, read and written once for both forms
//! that carry them: the packed answer and the gateway's bucket lines.

/// A pod's flags, written after `p` as letters: `r` ready, `t` terminating,
/// `h` host network, in that order, each at most once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodFlags {
    /// The pod is ready.
    pub ready: bool,
    /// The pod is terminating.
    pub terminating: bool,
    /// The pod runs in the node's network namespace.
    pub host_network: bool,
}

/// What reading a pod's flags does with a letter it does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownFlag {
    /// Skip it: a flag of a later release.
    Skip,
    /// Refuse the flags.
    Refuse,
}

/// Why a pod's flags could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// A letter no flag has (refused by [`UnknownFlag::Refuse`]).
    #[error("unknown pod flag `{0}`")]
    Unknown(char),
    /// A flag written twice.
    #[error("pod flag `{0}` twice")]
    Twice(char),
}

impl PodFlags {
    /// Appends the letters of the flags set to `out`.
    pub fn write(&self, out: &mut String) {
        for (set, letter) in [
            (self.ready, 'r'),
            (self.terminating, 't'),
            (self.host_network, 'h'),
        ] {
            if set {
                out.push(letter);
            }
        }
    }

    /// The flags as bits, as the binary forms carry them: `1` ready, `2`
    /// terminating, `4` host network.
    pub fn bits(&self) -> u8 {
        let Self {
            ready,
            terminating,
            host_network,
        } = *self;
        u8::from(ready) | u8::from(terminating) << 1 | u8::from(host_network) << 2
    }

    /// The flags of [`PodFlags::bits`]; other bits are not flags (a reader
    /// masks what it reads, or skips a later release's flags).
    pub fn from_bits(bits: u8) -> Self {
        Self {
            ready: bits & 1 != 0,
            terminating: bits & 2 != 0,
            host_network: bits & 4 != 0,
        }
    }

    /// Reads the letters [`PodFlags::write`] wrote; a letter it does not know
    /// is skipped or refused as `unknown` says.
    pub fn read(letters: &str, unknown: UnknownFlag) -> Result<Self, FlagError> {
        let mut flags = Self::default();
        for letter in letters.chars() {
            let slot = match letter {
                'r' => &mut flags.ready,
                't' => &mut flags.terminating,
                'h' => &mut flags.host_network,
                _ => match unknown {
                    UnknownFlag::Skip => continue,
                    UnknownFlag::Refuse => return Err(FlagError::Unknown(letter)),
                },
            };
            if std::mem::replace(slot, true) {
                return Err(FlagError::Twice(letter));
            }
        }
        Ok(flags)
    }
}
