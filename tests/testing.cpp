// Implementation of tests/testing.h lives here (launcher-backed). See testing.h.
#include "testing.h"
