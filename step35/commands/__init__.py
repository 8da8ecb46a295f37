"""The commands users run (`step35 fit|validate|export|generate|plan`): the top layer. Nothing below
imports from here."""
