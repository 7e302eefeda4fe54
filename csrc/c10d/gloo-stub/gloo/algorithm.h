#pragma once
#include <gloo/stub.h>
