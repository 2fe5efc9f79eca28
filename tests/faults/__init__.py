"""The fault and bad-input campaign (marker `faults`); see campaign.py and docs/GUARANTEES.md."""
